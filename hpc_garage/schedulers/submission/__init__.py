"""Submitting a job and following it: the mechanism every batch system shares, written once.

A submission either completes or leaves nothing behind (`submitting.py`: prepare, submit with undo, resubmit,
resume). Afterwards a job is known by its run directory (`finding.py`: find it across run roots, its state from
the batch system and `state.json`, in a few words), and followed (`following.py`: wait, cancel, logs). Its
progress in words is core/progress_text.py's, and how a terminal shows a job the CLI's (`cli/status_text.py`);
here is the data.
"""

from hpc_garage.schedulers.submission.finding import (JobView, check_job_id, find, lookup, records, refresh,
                                                      results_roots, run_dir_of, run_roots, status_all)
from hpc_garage.schedulers.submission.following import (CANCEL_MARGIN, SWEEP_SECONDS, cancel, cancel_follow_up,
                                                        log_files, logs, next_job_of, start_wind_down, wait)
from hpc_garage.schedulers.submission.submitting import (Prepared, Submitted, adopt, prepare, record_run_here,
                                                         resubmit, resume, submit)

__all__ = ["CANCEL_MARGIN", "SWEEP_SECONDS", "JobView", "Prepared", "Submitted", "adopt", "cancel", "cancel_follow_up",
           "check_job_id", "find", "log_files", "logs", "lookup", "next_job_of", "prepare", "record_run_here", "records",
           "refresh",
           "resubmit", "results_roots", "resume", "run_dir_of", "run_roots", "start_wind_down",
           "status_all", "submit", "wait"]
