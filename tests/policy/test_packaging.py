"""The policies and schemas ship inside the wheel, and a non-editable install loads the default
policy from there (not from the repository)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from veloxquant_mlx.policy.versions import VERSIONS

ROOT = Path(__file__).resolve().parents[2]


def test_force_include_covers_policies_and_schemas():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert include["policies"] == "veloxquant_mlx/_data/policies"
    assert include["schemas"] == "veloxquant_mlx/_data/schemas"
    for entry in VERSIONS.values():
        assert (ROOT / "policies" / entry.default_policy_file).is_file()
        assert (ROOT / "schemas" / entry.schema_file).is_file()
    assert pyproject["project"]["scripts"]["veloxquant"] == "veloxquant_mlx.cli.main:main"


def test_wheel_install_loads_packaged_policy(tmp_path):
    # About 8 s on the loaded 2-core dev machine: in the fast set (slow would be > 20 s).
    pytest.importorskip("hatchling")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(ROOT)], check=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    assert (target / "veloxquant_mlx" / "_data" / "policies" / "kv_cache_policy.v1.yaml").is_file()
    script = (
        "import veloxquant_mlx, json\n"
        "from veloxquant_mlx import WorkloadSpec, HardwareInfo, select_kv_cache_config\n"
        "from veloxquant_mlx.policy.sources import default_policy_path\n"
        "r = select_kv_cache_config(WorkloadSpec(128, 64000, 32, 4), HardwareInfo(32 * 2**30, 4 * 2**30))\n"
        "print(json.dumps({'module': veloxquant_mlx.__file__, 'policy': str(default_policy_path()),"
        " 'method': r.config.method, 'source': r.decision.policy_source}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VELOXQUANT_POLICY")}
    env["PYTHONPATH"] = str(target)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert out["module"].startswith(str(target))
    assert out["policy"].startswith(str(target / "veloxquant_mlx" / "_data" / "policies"))
    assert out["method"] == "kvquant"
