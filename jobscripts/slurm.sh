#!/bin/bash
#SBATCH --job-name=${job_name}
#SBATCH --nodes=${nodes}
#SBATCH --ntasks-per-node=${tasks_per_node}
#SBATCH --cpus-per-task=${cpus_per_task}
#SBATCH --mem=${memory}
#SBATCH --time=${walltime}
#SBATCH --output=${output}
${directives}
${body}
