"""The control protocol (blockflow/core/protocol.py): every message between the manager and its
processes is a Struct there, each one goes through ``encode`` and back unchanged, commands are
``Cmd`` members with typed arguments, a process answers the commands it has a ``cmd_<name>``
for, and the controller refuses a process that speaks another protocol version."""
from __future__ import annotations

import os

import msgspec
import pytest
import zmq

from blockflow.core import protocol
from blockflow.core.protocol import (ARGS, PROTOCOL_VERSION, BootFailure, Cmd, Command, ErrorCode, Fail, Gone, Host, Monitor,
                                NoArgs, Outstanding, Ready, Reply, Tasks, Topology, identity)
from blockflow.core.header import WireError

#: One example of the arguments of every command.
EXAMPLE_ARGS = {
    Cmd.PING: NoArgs(), Cmd.STOP: NoArgs(), Cmd.STORE: NoArgs(), Cmd.MONITOR: Monitor(False),
    Cmd.UPDATE: Topology(["ipc:///tmp/s/b1-0.sock"], {"ipc:///tmp/s/b1-0.sock": "cpu"},
                         {"tcp://10.0.0.2:5000": "ipc:///tmp/s/b1-0.sock"}, "zeromq"),
    Cmd.HOST: Host('{"name": "b1"}'),
    Cmd.TASKS: Tasks({"t": {"path": [["b1", "ipc:///tmp/s/b1-0.sock"]], "blocks": ["b1#0"], "input": None}}, 7),
    Cmd.FAIL: Fail(["b1#0"], "block b1 died"), Cmd.OUTSTANDING: Outstanding(["b1#0", "b2#3"])}


def test_every_command_has_its_arguments_declared():
    assert set(ARGS) == set(Cmd) == set(EXAMPLE_ARGS)


@pytest.mark.parametrize("cmd", list(Cmd), ids=str)
def test_a_command_and_its_arguments_round_trip(cmd):
    frame = protocol.encode(protocol.command(41, cmd, EXAMPLE_ARGS[cmd]))
    msg = protocol.decode_command(frame)
    assert (msg.id, Cmd(msg.cmd)) == (41, cmd)
    assert protocol.command_args(cmd, msg.args) == EXAMPLE_ARGS[cmd]
    # the same command from a dict of its fields (REST, the standalone pipeline) is checked the same way
    fields = msgspec.to_builtins(EXAMPLE_ARGS[cmd])
    assert protocol.command_args(cmd, protocol.command(41, cmd.value, fields).args) == EXAMPLE_ARGS[cmd]


@pytest.mark.parametrize("msg", [
    Ready("b1", 3, 1234, endpoint="ipc:///tmp/s/b1-3.sock", device="cpu"),
    Ready("@dispatcher", 0, 99, endpoint="tcp://127.0.0.1:5580", results=["ipc:///tmp/s/d.sock", "tcp://1.2.3.4:9"]),
    Ready("@grp", 1, 7, device="cuda:0"),
    BootFailure("b1", 0, 1234, "block b1: model toy/missing.pt not found"),
    Gone("b3#2", crashed=True),
    Reply(5, True, result={"pid": 1234, "members": ["b3#2"]}),
    Reply(6, False, error="ValueError: block b3#2 is hosted here already"),
], ids=lambda m: type(m).__name__)
def test_every_message_to_the_controller_round_trips(msg):
    assert protocol.decode_control(protocol.encode(msg)) == msg


def test_a_ready_says_the_protocol_version():
    assert msgspec.json.decode(protocol.encode(Ready("b1", 0, 1)))["v"] == PROTOCOL_VERSION


@pytest.mark.parametrize("frame,words", [
    (b'{"t": "cmd", "id": 1, "cmd": "ping", "args": {}}', "Object contains unknown field"),  # to the controller
    (b'{"t": "ready", "name": "b1", "inc": "zero", "pid": 1}', "$.inc"),
    (b'\x80\x04pickle', "not JSON"),
    (b'[1, 2]', "Expected `object`"),
], ids=["a-command", "ready-inc-a-string", "pickle", "array"])
def test_a_malformed_message_to_the_controller_is_refused_by_name(frame, words):
    with pytest.raises(WireError) as info:
        protocol.decode_control(frame)
    assert words in str(info.value) or "Invalid value 'cmd'" in str(info.value), info.value


def test_arguments_that_do_not_fit_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"arguments of fail: .*\$\.blocks"):
        protocol.command(1, Cmd.FAIL, {"blocks": "b1#0"})
    with pytest.raises(WireError, match=r"arguments of monitor: .*\$\.enabled"):
        protocol.command_args(Cmd.MONITOR, msgspec.Raw(b'{"enabled": "yes"}'))
    with pytest.raises(ValueError, match="'reboot' is not a valid Cmd"):
        protocol.command(1, "reboot")


def test_a_process_answers_the_commands_it_has_a_method_for(tmp_path):
    """Handlers are found from Cmd; a command the process has no method for (a newer manager's)
    is answered with the ones it knows."""
    from blockflow.blocks.process import Block
    from blockflow.blocks.spec import BlockSpec
    from blockflow.dispatcher.process import Dispatcher
    from blockflow.dispatcher.spec import DispatcherSpec
    from blockflow.core.childproc import Later, Mailbox
    block = Block(BlockSpec(name="a", model="toy/identity.pt", repo=str(tmp_path), run_dir=str(tmp_path),
                            sock_dir=str(tmp_path)))
    dispatcher = Dispatcher(DispatcherSpec(sock_dir=str(tmp_path)))
    for child, known in ((block, "block a knows monitor, ping, stop, store, update"),
                         (dispatcher, "dispatcher knows fail, outstanding, ping, stop, tasks, update")):
        with pytest.raises(ValueError) as err:
            child.handle_command("reboot", msgspec.Raw(b"{}"))
        assert "unknown command 'reboot'" in str(err.value) and known in str(err.value), err.value
    # the dispatcher's main loop answers it, from the mailbox (Note [Commands for the main loop])
    ctx = zmq.Context()
    dispatcher.mailbox = Mailbox(ctx, dispatcher.label, "main loop")
    try:
        later = dispatcher.handle_command("outstanding", msgspec.Raw(b'{"blocks": ["b1#0"]}'))
        assert isinstance(later, Later)
        later.rid = 5
        dispatcher.mailbox.serve()
        answers = []
        dispatcher.mailbox.collect(lambda rid, result=None, error=None: answers.append((rid, result, error)))
        assert answers == [(5, {"outstanding": 0}, None)]
    finally:
        dispatcher.mailbox.loop_end.close(linger=0)
        dispatcher.mailbox.control_end.close(linger=0)
        ctx.term()


def test_the_controller_refuses_a_process_of_another_protocol_version(short_tmp):
    from blockflow.manager.controller import ControlError, Controller
    ctx = zmq.Context()
    controller = Controller(ctx, f"ipc://{os.path.join(short_tmp, 'ctl.sock')}")
    controller.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        dealer.identity = identity("b1", 0)
        dealer.connect(controller.endpoint)
        dealer.send(protocol.encode(Ready("b1", 0, os.getpid(), v=PROTOCOL_VERSION + 1, endpoint="ipc:///x")))
        with pytest.raises(ControlError, match=f"speaks protocol version {PROTOCOL_VERSION + 1}"):
            controller.wait_ready(identity("b1", 0), timeout=10)
    finally:
        dealer.close()
        controller.stop()
        ctx.term()


def test_a_block_error_code_is_one_clients_know():
    assert ErrorCode.of("no_shared_memory") is ErrorCode.NO_SHARED_MEMORY
    assert ErrorCode.of(None) is ErrorCode.of("<script>") is ErrorCode.ERROR
    assert isinstance(Command(1, "ping").args, msgspec.Raw)


# -- the client's messages (tensormq/wire.py, Note [Client messages]) ---------------------------

def test_a_client_request_and_a_reply_round_trip():
    from blockflow.tensormq.wire import (ClientOp, ClientReply, ClientRequest, decode_reply, decode_request,
                                         encode_client)
    req = ClientRequest(PROTOCOL_VERSION, 12, ClientOp.INFER, task="t", timeout=2.5, out="shm",
                        x={"dtype": "float32", "shape": [1, 4], "stride": [4, 1], "loc": "bytes"},
                        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert decode_request(encode_client(req)) == req
    lend = ClientRequest(PROTOCOL_VERSION, "c-1", ClientOp.LEND, nbytes=4096, pid=os.getpid())
    assert decode_request(encode_client(lend)) == lend
    reply = ClientReply(PROTOCOL_VERSION, 12, "error", error="unknown task 'u'", code=ErrorCode.UNKNOWN_TASK.value)
    assert decode_reply(encode_client(reply)) == reply
    # what is not set is not written: a ping is a few bytes
    assert encode_client(ClientRequest(PROTOCOL_VERSION, 3, ClientOp.PING)) == b'{"v":1,"id":3,"op":"ping"}'


@pytest.mark.parametrize("frame, words", [
    (b'{"v":1,"id":1,"timeout":"soon"}', "$.timeout"),
    (b'{"v":1,"id":1,"timeout":-1}', "$.timeout"),
    (b'{"v":1,"id":1,"op":"shutdown"}', "$.op"),
    (b'{"v":1,"id":true}', "$.id"),
    (b'{"v":1,"id":"' + b"i" * 129 + b'"}', "$.id"),
    (b'{"v":1,"id":1,"out":"disk"}', "$.out"),
    (b'{"id":1,"task":"t"}', "`v`"),
    (b'{"v":2,"id":1}', "protocol version 2 is not this server's (1)"),
    (b'[1, 2]', "Expected `object`"),
])
def test_a_malformed_client_request_is_refused_by_name(frame, words):
    from blockflow.tensormq.wire import decode_request
    with pytest.raises(WireError) as exc:
        decode_request(frame)
    assert words in str(exc.value), exc.value


def test_the_id_of_a_refused_request_is_salvaged_when_it_is_valid():
    """The dispatcher answers a request it cannot decode with the request's own id, so that the
    client's call gets the error instead of waiting for its deadline."""
    from blockflow.tensormq.wire import salvage_id
    assert salvage_id(b'{"v":1,"id":7,"timeout":"soon"}') == 7
    assert salvage_id(b'{"id":"abc","op":"shutdown"}') == "abc"
    for frame in (b'{"id":true}', b'{"id":[1]}', b'{"id":"' + b"i" * 129 + b'"}', b"not json", b"[7]"):
        assert salvage_id(frame) is None, frame


def test_a_block_error_is_built_only_with_an_error_code():
    from blockflow.tensormq.wire import block_error, dumps, loads_header, read_block_error
    err = block_error(5, "b1", "block b1 is shutting down", ErrorCode.SHUTDOWN)
    back = read_block_error(loads_header(dumps(err)))
    assert back == err and ErrorCode.of(back.code) is ErrorCode.SHUTDOWN
    assert read_block_error(loads_header(dumps(block_error(6, "b1", "boom")))).code is None
    with pytest.raises(WireError, match=r"\$.rid"):
        read_block_error({"v": 1, "t": "error", "rid": -1, "block": "b1", "err": "x"})
