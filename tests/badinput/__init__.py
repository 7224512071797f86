"""The bad-input suite: what each entry point refuses, and how (collected by plain ``pytest``).

Every refusal reads ``name=value: problem; fix.`` (``--flag value: problem; fix.`` on the
command line), raises ``TypeError`` for a wrong type and ``ValueError`` for a value out of range,
``RuntimeError`` for a missing prerequisite, and happens before a trial is asked, a file is
written or a library (NumPy, torch, pandas) sees the value. Per entry point:

- ``waterwave-hpo demo|bench|doctor`` (``test_cli.py``, ``test_out_folders.py``): every option,
  a case each (a test reads the parsers and fails on an option without one); exit 2, no
  traceback. ``--seed`` outside 0..2**32-1, ``--budget-s`` inf/nan, ``--out ''``,
  ``--json ''`` refused after parsing. ``--out``: a file of a name the command writes that the
  project did not write (not in the folder's ``waterwave-run.json`` with its SHA-256) is
  refused naming its path, its bytes unchanged, one test per name; ``--json`` refuses an
  existing file that is not a doctor report. A second bench run of the day gets a new folder.
- ``WaterwaveExecutor(...)``, ``.optimize(...)``, ``create_study``/``load_study``/
  ``wrap_study``, the trial context outside a trial, ``RayExecutor``/``shared_gpu``/
  ``tune_hosts`` (``test_api_executor.py``, tables ``CONSTRUCTOR``, ``OPTIMIZE``, ``STUDIES``,
  ``OUTSIDE``, ``CLUSTER``): types, ranges, absurd sizes; with ``isolation="process"``, slots
  beyond the host memory their workers need (about 550 MiB each) and a ``memory_budget_bytes``
  below one byte per slot, both figures named.
- The engine's public parts: scheduler, simulator, pool, LaySA settings, report, doctor, demo
  and bench APIs (``test_api_engine.py``, ``ENGINE``); ``fit_memory``/``fit_trial_memory``,
  ``pipeline``/``node_groups``, fusion (``test_api_models.py``, ``FIT_MEMORY``,
  ``NODEGROUPS``, ``FUSION``): the model is left as it was.
- ``waterwave_hpo.distributed`` (``test_distributed.py``, ``test_ddp.py``): ``LaySAState``,
  ``NaiveTopKState``, ``laysa``, ``attach_baseline`` (each baseline) refuse
  ``process_group="gloo"`` (``TypeError``), no default group and a destroyed group
  (``RuntimeError`` naming ``init_process_group`` or ``new_group``; also under
  ``python -O``), before anything is registered; a second hook on one DDP model names
  ``ddp_model``.
- Objectives that return or do the unexpected (``test_objectives.py``): as Optuna's own
  ``Study.optimize`` ends them, never a trial left RUNNING.
- Storages that refuse writes, before or during a run (``test_storage.py``,
  ``test_probe_cases.py``): named with their cause, the trials left RUNNING listed with how
  to end them.
- Out of memory (``test_oom_reruns.py``): a trial whose known need exceeds the most it could
  ever get fails once, both figures in its reason, and is not re-run.
- Errors from a worker process (``test_worker_errors.py``): the type (or its name) and the
  host's traceback reach the driver.
- Ray (``test_ray.py``): advice that leads somewhere on a machine without GPUs.
"""
