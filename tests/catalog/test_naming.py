"""URI <-> filesystem path conversion and checkpoint-tagged commit file names."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from catalog.naming import (
    Locations,
    base_of_compaction_commit_file,
    checkpoint_of_commit_file,
    commit_uuid,
    merged_away_manifests,
)


def test_local_and_object_store_paths_round_trip():
    local = Locations.of("file:///w/state/t")
    assert isinstance(local.filesystem, pafs.LocalFileSystem)
    assert local.to_path("file:///w/state/t/data/x.parquet") == "/w/state/t/data/x.parquet"
    assert local.to_uri("/w/state/t/data/x.parquet") == "file:///w/state/t/data/x.parquet"
    s3 = Locations(pafs.LocalFileSystem(), "s3")  # conversion only: no S3 client is made
    assert s3.to_path("s3://bucket/t/data/x.parquet") == "bucket/t/data/x.parquet"
    assert s3.to_uri("bucket/t/data/x.parquet") == "s3://bucket/t/data/x.parquet"
    with pytest.raises(ValueError, match="not a s3 URI"):
        s3.to_path("gs://bucket/x")
    plain = Locations.of("/w/state/t")
    assert plain.to_uri("/w/x") == "/w/x" == plain.to_path("/w/x")


def test_commit_uuid_tags_round_trip_and_foreign_names_do_not_parse():
    for cp in (0, 1, 123456789012, 2**48 - 1):
        tag = commit_uuid(cp)
        assert checkpoint_of_commit_file(f"file:///t/metadata/{tag}-m0.avro") == cp
        assert checkpoint_of_commit_file(f"snap-42-0-{tag}.avro") == cp
    assert commit_uuid(5) != commit_uuid(5)
    assert checkpoint_of_commit_file("3f2a9c1e-1b2c-4d5e-8f90-123456789abc-m0.avro") is None
    assert checkpoint_of_commit_file("00001-abc.metadata.json") is None
    with pytest.raises(ValueError):
        commit_uuid(2**48)


def test_compaction_commits_carry_their_base_checkpoint_apart_from_checkpoint_commits():
    for cp in (0, 7, 2**48 - 1):
        main, fork = commit_uuid(cp, compaction=True), commit_uuid(cp, fork=True, compaction=True)
        assert base_of_compaction_commit_file(f"{main}-m3.avro") == cp
        assert base_of_compaction_commit_file(f"snap-1-0-{main}.avro") == cp
        assert checkpoint_of_commit_file(f"{main}-m3.avro") is None  # never read as a checkpoint's
        assert base_of_compaction_commit_file(f"{fork}-m0.avro") is None  # a fork's: not main's to sweep
        assert base_of_compaction_commit_file(f"{commit_uuid(cp)}-m0.avro") is None


def test_merged_away_manifests_are_the_unlisted_numbers_below_the_highest():
    tag = commit_uuid(3)
    listed = [f"file:///t/metadata/{tag}-m2.avro", "file:///t/metadata/other-m0.avro"]
    assert merged_away_manifests(tag, listed) == [f"file:///t/metadata/{tag}-m0.avro", f"file:///t/metadata/{tag}-m1.avro"]
    assert merged_away_manifests(tag, [f"file:///t/metadata/{tag}-m0.avro"]) == []
    assert merged_away_manifests(tag, ["file:///t/metadata/other-m0.avro"]) == []


@pytest.mark.parametrize("location", ["s3://bucket/wh/state/op", "/tmp/wh/state/op", "file:///tmp/data/op"])
def test_a_segment_path_names_its_table(location):
    from statestore.paths import segment_path, table_location_of

    assert table_location_of(segment_path(location, 7, 1, 2)) == location
    assert table_location_of(segment_path(location, 7, 1, 2, subdir="branches/b1/c000000000000")) == location
