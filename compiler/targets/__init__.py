"""Target profiles as data (profiles/*.yaml). The loader lives in `surgery.targets`."""
