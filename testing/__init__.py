"""What tests, benchmarks and examples share from a checkout: starting a daemon and the processes they drive.

Not part of the wheel: a node runs ``hbmd`` under its service manager, not through these helpers.
"""
