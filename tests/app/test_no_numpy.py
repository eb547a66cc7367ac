"""A fresh install has no numpy (it is not a dependency): `fusedzero train` must stay quiet.

`import torch` warns "Failed to initialize NumPy" when numpy is missing, once per process (the
launcher and each rank). The run happens in a child interpreter whose sitecustomize makes
numpy look missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns ranks or the CLI

# None in sys.modules: `import numpy` raises ModuleNotFoundError and importlib.util.find_spec
# answers None, exactly as when numpy is not installed.
BLOCK_NUMPY = "import sys\nsys.modules['numpy'] = None\n"


def test_train_without_numpy_prints_no_numpy_warning(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_NUMPY)
    corpus = tmp_path / "argparse.py"
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py", corpus)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    # TRITON_INTERPRET=0 as in a user's environment (the interpreter itself needs numpy).
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "0"}
    env.pop("PYTHONWARNINGS", None)
    probe = subprocess.run(
        [sys.executable, "-c", "import numpy"], env=env, capture_output=True, text=True, timeout=60
    )
    assert probe.returncode != 0, "the numpy blocker is not active in the child"
    argv = [
        "train",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--block-size",
        "32",
        "--batch-size",
        "4",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--eval-seqs",
        "4",
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--no-progress",
        "--data",
        str(corpus),
    ]
    p = subprocess.run(
        [sys.executable, "-m", "fusedzero.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "NumPy" not in p.stderr and "numpy" not in p.stderr, p.stderr[-3000:]
    assert "Warning" not in p.stderr, f"warning noise on the main job:\n{p.stderr[-3000:]}"
