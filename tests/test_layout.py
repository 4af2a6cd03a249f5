"""The house rules: one import root, settings read in one place, documented in the README."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT_DIRS = ["blockflow", "blocks", "dispatcher", "manager", "tensormq"]


def _product_files():
    for d in PRODUCT_DIRS:
        for name in sorted(os.listdir(os.path.join(ROOT, d))):
            if name.endswith(".py"):
                yield os.path.join(d, name)


def test_every_setting_is_read_in_settings_py_only():
    offenders = []
    for rel in _product_files():
        if rel == os.path.join("blockflow", "settings.py"):
            continue
        with open(os.path.join(ROOT, rel)) as f:
            for i, line in enumerate(f, 1):
                if re.search(r"environ(\.get)?[\[(]\s*[\"']BLOCKFLOW_", line):
                    offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "read BLOCKFLOW_* settings through blockflow.settings:\n" + "\n".join(offenders)


def test_readme_settings_table_is_generated_from_settings_py():
    from blockflow import settings
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert settings.markdown_table() in readme, "regenerate the README table: python -m blockflow.settings"


def test_product_code_imports_through_one_root():
    bad = []
    for rel in _product_files():
        with open(os.path.join(ROOT, rel)) as f:
            for i, line in enumerate(f, 1):
                if re.match(r"\s*(from|import) (blocks|manager|dispatcher|tensormq|experiments|tests)\b", line):
                    bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "product modules import blockflow.* only (never experiments or tests):\n" + "\n".join(bad)
