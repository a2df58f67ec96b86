python3 -m pip install -q --no-index --find-links .whl .whl/*.whl 2>&1 | tail -1; python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
echo "== gpu tests"; timeout 120 python3 -m pytest -q -x tests/engine/test_batch_gpu.py tests/kernels/test_moe_experts.py 2>&1 | tail -3
echo "== service"; timeout 230 python3 bench/service_throughput.py --tokenizer-dir .carry/tok 2>&1 | grep -E "engine alone:|docs|----|PFlash|service|job_results" | grep -v Warn
echo "== throughput"; timeout 190 python3 bench/throughput.py --single-docs 2 --mixed-docs 32 2>&1 | grep -v Warn | tail -9
echo "== v4 moe"; timeout 50 python3 bench/v4_moe.py 2>&1 | tail -8
