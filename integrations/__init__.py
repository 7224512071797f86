"""Adapters to HPO frameworks, importable as ``waterwave_hpo.integrations``.

- :mod:`waterwave_hpo.integrations.optuna`: ``create_study``/``load_study`` returning a study whose
  ``optimize`` takes ``executor=``.
"""
