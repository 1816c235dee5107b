"""Every use of another package's private names, in one place, each with the versions it was verified on.

hpc-garage reaches into distributed, dask-jobqueue, Prefect and prefect-dask where they have no public hook
for what it needs (the reason is given at each use). Those names can change in any release, so:
- each use is declared with `@uses(package, what)` (versions.py); `VERIFIED` is the range of each package
  the uses were checked against, and `pyproject.toml`'s bounds are the same ranges (a test holds them equal);
- outside its range, or where the name is gone, a use either falls back (said where) or raises
  `CompatError`, one line naming the package, its version and the range, never an AttributeError.
One module per package whose names are touched: distributed.py, dask_jobqueue.py, prefect.py, prefect_dask.py
(and prefect_server.py: Prefect's server, in the managed server's own process);
every name is imported from here. `uses_outside_range()` lists what the installed versions put at risk;
`hpc-garage --version` imports only this package's standard-library side (the packages it names are imported
lazily, per use).
"""

from __future__ import annotations

from hpc_garage.compat.versions import (USES, VERIFIED, CompatError, Use, at_least, in_range, installed_versions, main,
                                        newest_release, registry_releases, release_news, uses, uses_outside_range,
                                        version)
from hpc_garage.compat.distributed import (attached_spec_cluster, correct_state, executing_now, hold_pause,
                                           quiet_expected_closes,
                                           pause_workers, replace_valid_workers, run_on_workers, scheduler_at,
                                           skip_forkserver_optional_preload, trim_span_metadata)
from hpc_garage.compat.dask_jobqueue import hooked_job
from hpc_garage.compat.prefect import (answer_cached_tag_limits_in_thread, before_exit_drains, cache_policy_unset,
                                       context_var, deployment_context, has_context_vars, has_deployment_context,
                                       keep_flow_states, queued_log, rebuild_context_models, stretch_no_tag_limits_cache,
                                       tag_limits_survive_outages, take_queued, unconfirmed_events)
from hpc_garage.compat.prefect_server import insert_batches_once_compiled
from hpc_garage.compat.prefect_dask import (dask_futures, release_future, releasing_future_class, runner_has_cluster,
                                            runner_started)

__all__ = ["USES", "VERIFIED", "CompatError", "Use", "answer_cached_tag_limits_in_thread", "at_least",
           "attached_spec_cluster", "before_exit_drains", "executing_now",
           "cache_policy_unset", "context_var", "correct_state", "dask_futures", "deployment_context",
           "has_context_vars", "has_deployment_context", "hold_pause", "hooked_job", "in_range", "insert_batches_once_compiled", "installed_versions",
           "keep_flow_states", "main", "newest_release", "pause_workers", "quiet_expected_closes", "queued_log", "rebuild_context_models",
           "registry_releases", "release_future", "release_news", "releasing_future_class", "replace_valid_workers", "run_on_workers", "runner_has_cluster",
           "runner_started", "scheduler_at", "skip_forkserver_optional_preload", "stretch_no_tag_limits_cache",
           "tag_limits_survive_outages", "take_queued", "trim_span_metadata", "unconfirmed_events", "uses", "uses_outside_range", "version"]
