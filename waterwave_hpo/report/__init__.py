"""What a run leaves for a person to read: the trials table, concurrency, and a timeline."""

from waterwave_hpo.report._concurrency import max_concurrent_trials
from waterwave_hpo.report._table import trials_table
from waterwave_hpo.report._timeline import plot_timeline

__all__ = ["max_concurrent_trials", "plot_timeline", "trials_table"]
