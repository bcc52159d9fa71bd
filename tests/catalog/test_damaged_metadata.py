"""Errors that say what is wrong: a damaged metadata.json, manifest list or
manifest is reported as CorruptMetadataError naming the file and what to do, not as a decode
error of pyiceberg's; a zombie writer whose successor committed and expired gets a commit
conflict, not a FileNotFoundError."""

from __future__ import annotations

import glob
import os

import pytest

from catalog import IcebergStateTable
from catalog.fileio import METADATA_FILES
from statestore.errors import CommitConflictError, CorruptMetadataError
from tests.catalog.catalog_helpers import LAYOUT, commit_next


def damage(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"garbage\xff\xfe")
    METADATA_FILES.clear()  # as a fresh process: no copy of the bytes this process wrote


def _varint(n: int) -> bytes:
    n, out = (n << 1) ^ (n >> 63), bytearray()  # Avro's zig-zag long
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes([*out, n])


def nest_deeply(path: str) -> None:
    """Replace the file by a hostile one nesting its JSON 5,000 deep: an Avro file whose header
    schema is arrays of arrays (a metadata.json: lists of lists), which recursive parsers do not survive."""
    if path.endswith(".json"):
        text = b"[" * 5000 + b"]" * 5000
    else:
        schema = b'{"type":"array","items":' * 5000 + b'"int"' + b"}" * 5000
        meta = {b"avro.schema": schema, b"avro.codec": b"null"}
        text = b"Obj\x01" + _varint(len(meta)) + b"".join(
            _varint(len(k)) + k + _varint(len(v)) + v for k, v in meta.items()) + _varint(0) + bytes(16)
    with open(path, "wb") as f:
        f.write(text)
    METADATA_FILES.clear()


def newest(pattern: str) -> str:
    return max(glob.glob(pattern), key=os.path.getmtime)


@pytest.mark.parametrize("how", [damage, nest_deeply])
@pytest.mark.parametrize("which", ["manifest list", "manifest", "metadata file"])
def test_a_damaged_metadata_file_is_named(open_table, warehouse: str, which: str, how):
    table = open_table()
    commit_next(table)
    commit_next(table)
    table.close()
    metadata = os.path.join(warehouse, "state", "op", "metadata")
    target = {"manifest list": f"{metadata}/snap-*.avro", "manifest": f"{metadata}/*-m*.avro",
              "metadata file": f"{metadata}/*.metadata.json"}[which]
    path = newest(target) if which != "metadata file" else max(glob.glob(target))
    how(path)
    with pytest.raises(CorruptMetadataError, match=os.path.basename(path)) as raised:
        IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op").close()
    assert ("icestate recover" if which == "metadata file" else "Restore it from a backup") in str(raised.value)


def test_a_zombie_writer_gets_a_conflict(open_table):
    zombie = open_table(retain_checkpoints=1)
    commit_next(zombie)
    commit_next(zombie)
    successor = open_table(retain_checkpoints=1)
    for _ in range(3):  # commits and expires what the zombie's metadata still points at
        commit_next(successor)
    with pytest.raises(CommitConflictError, match="another writer committed checkpoint 5"):
        commit_next(zombie)


def test_the_catalogs_avro_reads_use_the_bounded_decoder():
    """pyiceberg 0.12's Cython decoder reads past its buffer on some damaged manifests and crashed
    the process (a segmentation fault in ``test_fuzz_damage``, about one run in four); the
    manifests and manifest lists the catalog reads are decoded by pyiceberg's pure-Python
    decoder, which raises instead. Outside those reads pyiceberg keeps its fast decoder."""
    import pyiceberg.avro.file
    from pyiceberg.avro.decoder import StreamingBinaryDecoder

    from catalog.manifests import bounded_avro

    data = _varint(1 << 20) + b"short"  # a length past the end of the bytes
    with bounded_avro():
        decoder = pyiceberg.avro.file.new_decoder(data)
        assert isinstance(decoder, StreamingBinaryDecoder)
        with pytest.raises(EOFError):
            decoder.read_bytes()
    assert not isinstance(pyiceberg.avro.file.new_decoder(data), StreamingBinaryDecoder)


def test_the_bounded_decoder_refuses_a_negative_length_the_fast_one_would_fail_on():
    """pyiceberg's pure decoder read a negative length as empty bytes, so a damaged manifest
    (a bound's length overwritten) passed the catalog's bounded read and then failed in a scan's
    fast read with SystemError instead of ``CorruptMetadataError`` (found by ``test_fuzz_damage``
    in CI). The bounded decoder takes a negative length as damage, in reads and skips."""
    import pyiceberg.avro.file

    from catalog.manifests import bounded_avro

    data = _varint(-5) + b"12345"
    with bounded_avro():
        for read in ("read_bytes", "read_utf8", "skip_bytes", "skip_utf8"):
            decoder = pyiceberg.avro.file.new_decoder(data)
            with pytest.raises(ValueError, match="negative length"):
                getattr(decoder, read)()
        assert pyiceberg.avro.file.new_decoder(_varint(0)).read_bytes() == b""
        assert pyiceberg.avro.file.new_decoder(_varint(3) + b"abc").read_utf8() == "abc"
    with pytest.raises(SystemError):  # what the fast decoder does with the same bytes
        pyiceberg.avro.file.new_decoder(data).read_bytes()


def test_avro_bytes_not_decoded_whole_before_get_the_bounded_decoder_in_any_thread(open_table, warehouse: str):
    """pyiceberg reads manifests in threads of its own (a scan's plan, a commit's merge), where
    the catalog's ``bounded_avro`` does not reach: a damaged manifest met there first went to the
    Cython decoder. Now any Avro file is decoded by the bounded decoder until its bytes were
    decoded whole without error (or written by pyiceberg) in this process, in whichever thread."""
    from concurrent.futures import ThreadPoolExecutor

    from pyiceberg.avro.decoder import StreamingBinaryDecoder
    from pyiceberg.avro.file import AvroFile

    table = open_table()
    commit_next(table)
    table.close()
    path = newest(os.path.join(warehouse, "state", "op", "metadata", "snap-*.avro"))
    with open(path, "rb") as f:
        data = f.read()
    at = data.index(b"Location URI")  # a field's doc in the header's schema: other bytes, as valid
    with open(path, "wb") as f:
        f.write(data[:at] + b"l" + data[at + 1:])
    METADATA_FILES.clear()
    io = table.iceberg_table.io

    def read() -> tuple[bool, int]:
        with AvroFile(io.new_input(f"file://{path}")) as avro:
            return isinstance(avro.decoder, StreamingBinaryDecoder), len(list(avro))

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(read).result() == (True, 1)  # first seen: the bounded decoder, read whole
        assert pool.submit(read).result() == (False, 1)  # the same bytes again: the fast one


@pytest.mark.parametrize("cut", ["inside its block", "after its header"])
def test_a_manifest_list_cut_short_is_named(open_table, warehouse: str, cut: str):
    """pyiceberg ends an Avro file quietly at an end of file inside a block: a manifest list cut
    in its block opened its checkpoint without a segment. An Avro file must end at a block's end,
    and a manifest list has a block."""
    table = open_table()
    commit_next(table)
    commit_next(table)
    table.close()
    path = newest(os.path.join(warehouse, "state", "op", "metadata", "snap-*.avro"))
    with open(path, "rb") as f:
        data = f.read()
    from pyiceberg.avro.file import AvroFile

    with AvroFile(table.iceberg_table.io.new_input(f"file://{path}")) as avro:
        header_end = avro.decoder.tell()
    os.truncate(path, len(data) - 40 if cut == "inside its block" else header_end)
    METADATA_FILES.clear()
    with pytest.raises(CorruptMetadataError, match=rf"{os.path.basename(path)}.*is cut short"):
        IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op").close()
