"""The proto declares its resources, references and field behaviours (AIP-122, 123, 203), every
string and repeated field of a request says its bound, and `buf lint` passes with the deviations
buf.yaml records."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.api import field_behavior_pb2, resource_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvquota.v1 import admin_pb2, admission_pb2, billing_pb2, resources_pb2

ROOT = Path(__file__).resolve().parents[2]
FILES = (admission_pb2, admin_pb2, billing_pb2, resources_pb2)
MESSAGES: list[Descriptor] = [m for f in FILES for m in f.DESCRIPTOR.message_types_by_name.values()]
# Fields that hold a resource's name, whatever their message.
NAME_FIELDS = {"name", "parent", "tenant", "instance", "tenants", "reservation", "principal"}
BOUND = re.compile(r"at most|\{0,62\}|\{1,128\}|exactly", re.IGNORECASE)


@pytest.fixture(scope="module")
def protogen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "scripts" / "protogen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _resource(message: Descriptor) -> resource_pb2.ResourceDescriptor | None:
    options = message.GetOptions()
    if not options.HasExtension(resource_pb2.resource):
        return None
    return options.Extensions[resource_pb2.resource]


def _reference(field: FieldDescriptor) -> resource_pb2.ResourceReference | None:
    options = field.GetOptions()
    if not options.HasExtension(resource_pb2.resource_reference):
        return None
    return options.Extensions[resource_pb2.resource_reference]


def _behaviors(field: FieldDescriptor) -> list[int]:
    return list(field.GetOptions().Extensions[field_behavior_pb2.field_behavior])


def test_every_resource_is_declared_with_an_identifier_name() -> None:
    declared = {m.name: _resource(m) for m in MESSAGES}
    for message in MESSAGES:
        first = message.fields[0] if message.fields else None
        named = (
            first is not None
            and first.name == "name"
            and not message.name.endswith(("Request", "Response"))
        )
        resource = declared[message.name]
        assert (resource is not None) == named, message.name
        if resource is not None:
            assert resource.type == f"kvquota/{message.name}" and resource.pattern
            assert first is not None and _behaviors(first) == [field_behavior_pb2.IDENTIFIER]


def test_every_name_field_references_a_declared_resource() -> None:
    """In requests and resources (an audit event's principal may be "anonymous": not a name)."""
    types = {r.type for m in MESSAGES if (r := _resource(m)) is not None} | {"*"}
    for message in MESSAGES:
        if not (message.name.endswith("Request") or _resource(message) is not None):
            continue
        for field in message.fields:
            if field.type != field.TYPE_STRING or field.name not in NAME_FIELDS:
                continue
            reference = _reference(field)
            if field.name == "name" and _resource(message) is not None:
                continue  # the resource's own name
            assert reference is not None, f"{message.name}.{field.name}"
            assert (reference.type or reference.child_type) in types


def test_requests_say_what_is_required_and_every_bound(protogen: ModuleType) -> None:
    comments = {}
    for file in protogen.descriptor_set().file:
        for index, message in enumerate(file.message_type):
            for number, field in enumerate(message.field):
                for location in file.source_code_info.location:
                    if tuple(location.path) == (4, index, 2, number):
                        comments[(message.name, field.name)] = location.leading_comments
    for message in MESSAGES:
        if not message.name.endswith("Request"):
            continue
        assert any(
            field_behavior_pb2.REQUIRED in _behaviors(f) for f in message.fields
        ) or message.name.startswith("List"), f"{message.name} names no required field"
        for field in message.fields:
            bounded = field.type == field.TYPE_STRING or field.is_repeated
            if not bounded or field.message_type is not None:
                continue
            comment = comments.get((message.name, field.name), "")
            assert _reference(field) is not None or BOUND.search(comment), (
                f"{message.name}.{field.name} states no bound"
            )


def test_buf_lint_passes(protogen: ModuleType) -> None:
    protogen.lint()
