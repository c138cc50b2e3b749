"""The reliability suite. Its shared helpers live beside this file: `figures.py`
(`trials`, `record`, `record_row`, `FULL`) and `training_runs.py` (tiny BERT runs on Ray). Import
them by module name (pytest puts this directory on `sys.path`; a module named `conftest` would
clash with tests/conftest.py).
"""
