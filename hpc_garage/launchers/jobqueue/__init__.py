"""The jobqueue launcher: workers in batch jobs of their own, submitted and cancelled as work comes and goes.
`plan` is what `run` reads before it starts (the workers it waits for, when the run ends); `jobs` renders,
submits and cancels the worker jobs through dask-jobqueue (job script, job and cluster classes, the file a
job reads, every job id this run was given); `scaling` is the policy, pure, with time passed in (job states
and records, when a job expires, is gone, has finished retiring, a new job's walltime, when a pool gives up,
and how many jobs each pool needs); `records` keeps every job's record, its events and the stopped pools
(worker-jobs.json); `retirement` drains and retires a job's workers on the scheduler as the policy says;
`launcher` is the `JobqueueLauncher` whose loop observes the scheduler, asks the batch system and applies
that policy; `worker` is the worker job's own entry point (`python -m hpc_garage.launchers.jobqueue.worker`).
Nothing is imported here, so the worker job and `show` load only what they use.
"""
