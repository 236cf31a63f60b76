# Sourced by the GPU session scripts of an FA4 call (the second of the two staging calls, within
# 30 s of the first: see README.md): installs FA4 from .gpu/fa4-2 (carried), puts its site on
# PYTHONPATH, then src after it, with the timing settings every benchmark call uses.
bash .gpu/fa4-2/install.sh > /tmp/fa4-install.log 2>&1 || { echo "fa4 install failed"; tail -5 /tmp/fa4-install.log; exit 1; }
. /opt/fa4site/env.sh
export PYTHONUNBUFFERED=1 CPATTN_TRITON_AUTOTUNE=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
