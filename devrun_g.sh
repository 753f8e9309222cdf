export PYTHONPATH=src:. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
F="^WARNING\|^I0000\|^W0000\|^E0000"
timeout -s KILL 570 python3 -u -m experiments.precision_study --preset small --fit-seq 0 --batch 16 --steps 16 --precisions bf16,fp8 --profile /tmp/prof 2>&1 | grep -v "$F" > $OUT/study.txt
tail -40 $OUT/study.txt
