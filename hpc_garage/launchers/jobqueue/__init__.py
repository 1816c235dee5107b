"""The jobqueue launcher: workers in batch jobs of their own, submitted and cancelled as work comes and goes.
`jobs` renders and submits the worker jobs through dask-jobqueue (job script, job and cluster classes, the
file a job reads, every job id this run was given); `scaling` is the policy, pure, with time passed in (job
states and records, when a job expires, is gone, has finished retiring, when a pool gives up, and how many
jobs each pool needs); `launcher` is the `JobqueueLauncher` that observes the scheduler, asks the batch
system and applies that policy; `worker` is the worker job's own entry point
(`python -m hpc_garage.launchers.jobqueue.worker`). Nothing is imported here, so the worker job and `show`
load only what they use.
"""
