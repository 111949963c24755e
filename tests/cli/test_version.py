"""`qurl --version`: the version the package carries (setup.py reads the same one) and where the package is."""
import re
from pathlib import Path

import pytest

import qurl_mcore
from qurl_mcore.cli import main


def test_version_prints_the_package_version_and_its_location(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"qurl-mcore {qurl_mcore.__version__} ({Path(qurl_mcore.__file__).parent})"


def test_setup_py_reads_its_version_from_the_package():
    setup_py = (Path(qurl_mcore.__file__).parent.parent / "setup.py").read_text()
    assert "version=VERSION" in setup_py and not re.search(r'version="\d', setup_py)
    assert (Path(qurl_mcore.__file__).parent / "py.typed").is_file()
