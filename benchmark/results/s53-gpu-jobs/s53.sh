# Session 53's calls 7 and 8 (JOB=chat, JOB=t07): session 43's job at HEAD, files named -s53.
# (As run, this file held a copy of s43.sh's lines with the t07 case added; s43.sh now has it.)
TAG=s53 exec bash benchmark/results/s43-gpu-jobs/s43.sh
