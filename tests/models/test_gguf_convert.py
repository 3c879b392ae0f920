"""The GGUF conversion runs in a child process (lmppo.models.gguf_convert): its failure comes back as one LmppoError,
not as the child's traceback. The successful conversion of the packaged model: tests/models/test_assets.py."""

import pytest

from lmppo.errors import LmppoError
from lmppo.models.gguf_convert import convert_gguf


def test_a_broken_file_fails_in_the_child_with_one_error(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 60)  # the magic, then nothing a reader can use
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(LmppoError) as err:
        convert_gguf(broken, out, {"marker": "converted.json"}, out)
    message = str(err.value)
    assert message.startswith("converting broken.gguf failed: ValueError: ") and "GGUF v0" in message, message
    assert "Traceback" not in message and 'File "' not in message
    assert not (out / "converted.json").exists()  # the marker is written last, only on success
