"""The stored-key names: one prefix, and the fallback to the names older versions stored."""

from __future__ import annotations

from statestore import stored_keys


def test_every_stored_key_has_the_one_prefix():
    names = [v for k, v in vars(stored_keys).items() if k.isupper() and isinstance(v, str)
             and k not in ("PREFIX", "LEGACY_PREFIX", "PARTITION_FIELD_PREFIX")]
    assert names and all(n.startswith("icestate.") for n in names), names
    assert stored_keys.fork_base_key("f").startswith("icestate.")
    assert stored_keys.last_checkpoint_id_key("f") == "icestate.last-checkpoint-id@f"


def test_legacy_names_are_those_older_versions_wrote():
    assert stored_keys.legacy_name(stored_keys.SUMMARY_CHECKPOINT_ID) == "statestore.checkpoint-id"
    assert stored_keys.legacy_name(stored_keys.fork_base_key("f")) == "statestore.fork-base@f"
    assert stored_keys.legacy_name(stored_keys.last_checkpoint_id_key("f")) == "statestore.last-checkpoint-id@f"
    assert stored_keys.legacy_name(stored_keys.QUERY_WATERMARK_MS) is None  # always had the icestate name
    assert stored_keys.current_name("statestore.layout") == stored_keys.LAYOUT
    assert stored_keys.current_name("statestore.note") == "statestore.note"  # not ours: a user's name


def test_reads_fall_back_to_the_legacy_name_and_prefer_the_current_one():
    old = {"statestore.last-checkpoint-id": "5", "statestore.layout": "L", "other": "x"}
    assert stored_keys.get(old, stored_keys.LAST_CHECKPOINT_ID) == "5"
    assert stored_keys.get(old, stored_keys.PARTITION_WIDTH, "8") == "8"
    both = {**old, stored_keys.LAST_CHECKPOINT_ID: "6"}
    assert stored_keys.get(both, stored_keys.LAST_CHECKPOINT_ID) == "6"
    assert stored_keys.upgraded(both) == {stored_keys.LAST_CHECKPOINT_ID: "6", stored_keys.LAYOUT: "L", "other": "x"}
    assert stored_keys.is_reserved_summary_key("statestore.checkpoint-id")
    assert stored_keys.is_reserved_summary_key(stored_keys.SUMMARY_OPERATOR_STATE)
    assert not stored_keys.is_reserved_summary_key(stored_keys.QUERY_ID)
