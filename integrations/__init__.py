"""Adapters to HPO frameworks, importable as ``waterwave_hpo.integrations``.

- :mod:`waterwave_hpo.integrations.optuna`: ``create_study``/``load_study`` returning a study whose
  ``optimize`` takes ``executor=``.
- :mod:`waterwave_hpo.integrations.ray_tune`: ``shared_gpu()`` for Ray Tune, memory leases per GPU
  (needs the ``ray`` extra).
"""
