#!/bin/bash
#PBS -N ${job_name}
#PBS -l select=${select}
#PBS -l walltime=${walltime}
#PBS -j oe
#PBS -o ${output}
${directives}
${body}
