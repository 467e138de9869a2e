"""Counters the fault-injection tests add to; conftest.py prints them once at the end of the test run."""

TALLY = {"trials": 0, "faults": 0, "hangs": 0, "disagreements": 0, "torn_files": 0}
