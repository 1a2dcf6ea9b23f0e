# The A/B of offline-ab.txt: build/exp/old and build/exp/new hold engine.py and request.py of 84d9c04~1 and 84d9c04.
for v in new old new old; do
  cp build/exp/$v/engine.py build/exp/$v/request.py exlcli/engine/
  timeout 120 python3 docs/gpu-runs/run24/offline_once.py fp8 $v 2>&1 | grep -v "^\[" | tail -2
done
cp build/exp/new/engine.py build/exp/new/request.py exlcli/engine/
