"""The scripts in tests/frameworks/ are run by test_frameworks.py under torchrun, not collected."""

collect_ignore_glob = ["frameworks/*"]
