"""The reliability suite (issue 8). Its shared helpers (`trials`, `record`, `FULL`) live in
`figures.py` beside this file: import them with `from figures import record, trials` (pytest puts
this directory on `sys.path`; a module named `conftest` would clash with tests/conftest.py).
"""
