"""Support code of the Python tests that is not itself a test file: the differential fuzzer
(fuzz.py, also a command-line tool) and the torchrun entry of the AutoEP example test
(autoep_launch.py)."""
