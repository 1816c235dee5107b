
# Rendered by hpc-garage ${version} for site ${site_name}. Below: plain bash. Every word that came from the
# command line is quoted; the site's setup lines are the site's own shell code. `run` starts Dask in this
# allocation (one worker per task slot above), then runs the script with $$HPC_GARAGE_SCHEDULER_FILE set.
${ranks}
${container_note}
cd ${workdir} || exit 1
${setup}
PY=${python}
exec "$$PY" -m hpc_garage run --site ${site}${sweep}${container} -- ${inner} ${command}
