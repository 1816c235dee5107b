"""Adaptive search (`hpc_garage.search`): an Optuna study whose trials run on every worker of the job.

settings.py checks what the search is asked; ledger.py says when it stops asking; search.py drives the study;
leaderboard.py writes what status, the report and Prefect show. Optuna is imported only when a search runs.
"""
