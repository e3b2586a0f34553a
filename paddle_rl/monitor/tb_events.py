"""TensorBoard event files, written and read without TensorFlow, tensorboard or tensorboardX.

A file `events.out.tfevents.<time>.<host>.<pid>` is a sequence of TFRecords:
    uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
(little endian; masked crc = rotate-right-15(crc32c) + 0xa282ead8), each `data` an `Event` protobuf
(tensorflow/core/util/event.proto, summary.proto). The fields used here, encoded by hand:
    Event:         wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5,
                   session_log = 7
    Summary:       value = 1 (repeated Summary.Value)
    Summary.Value: tag = 1 (string), simple_value = 2 (float)
    SessionLog:    status = 1 (enum; START = 1: TensorBoard drops events of later steps written before it)
The first record is the version event "brain.Event:2".
"""
import os
import socket
import struct
import time
from typing import Iterator, List, NamedTuple, Optional

FILE_VERSION = "brain.Event:2"
_MASK_DELTA = 0xA282EAD8
_START = 1


def _crc32c_table() -> List[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecord framing."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# ---------------------------------------------------------------- protobuf wire format
def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 two's complement, as protobuf writes negative int64
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: Optional[int], body: bytes) -> bytes:
    head = _key(1, 1) + struct.pack("<d", wall_time)
    if step:
        head += _key(2, 0) + _varint(step)
    return head + body


def encode_version_event(wall_time: float) -> bytes:
    return _event(wall_time, None, _length_delimited(3, FILE_VERSION.encode()))


def encode_scalar_event(wall_time: float, step: int, tag: str, value: float) -> bytes:
    summary_value = _length_delimited(1, tag.encode("utf-8")) + _key(2, 5) + struct.pack("<f", value)
    return _event(wall_time, step, _length_delimited(5, _length_delimited(1, summary_value)))


def encode_session_start_event(wall_time: float, step: int) -> bytes:
    return _event(wall_time, step, _length_delimited(7, _key(1, 0) + _varint(_START)))


def frame_record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFileWriter:
    """Scalars for TensorBoard: one new event file per writer in `logdir`."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "wb")
        self._write(encode_version_event(time.time()))
        self.flush()

    def _write(self, event: bytes) -> None:
        self._file.write(frame_record(event))

    def add_scalar(self, tag: str, value: float, step: int, wall_time: Optional[float] = None) -> None:
        self._write(encode_scalar_event(time.time() if wall_time is None else wall_time, step, tag, float(value)))

    def add_session_start(self, step: int) -> None:
        """Mark a restart at `step`: TensorBoard discards events of steps >= `step` from earlier files."""
        self._write(encode_session_start_event(time.time(), step))

    def flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


# ---------------------------------------------------------------- reading (tests, tools)
class EventFileError(ValueError):
    """A truncated or corrupt event file; the message names the file and the byte offset."""


def read_records(path: str) -> Iterator[bytes]:
    """The data of each record, CRCs checked."""
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos < len(blob):
        if pos + 12 > len(blob):
            raise EventFileError(f"{path}: truncated record header at byte {pos}")
        length_bytes = blob[pos:pos + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", blob[pos + 8:pos + 12])
        if length_crc != masked_crc32c(length_bytes):
            raise EventFileError(f"{path}: bad length checksum at byte {pos}")
        end = pos + 12 + length + 4
        if end > len(blob):
            raise EventFileError(f"{path}: truncated record at byte {pos}")
        data = blob[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[end - 4:end])
        if data_crc != masked_crc32c(data):
            raise EventFileError(f"{path}: bad data checksum at byte {pos}")
        yield data
        pos = end


def _fields(buf: bytes) -> Iterator[tuple]:
    """(field number, wire type, value) of one protobuf message: ints for varints, bytes otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise EventFileError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def _read_varint(buf: bytes, pos: int) -> tuple:
    shift = result = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


class Scalar(NamedTuple):
    step: int
    tag: str
    value: float
    wall_time: float


class Event(NamedTuple):
    wall_time: float
    step: int
    file_version: Optional[str]
    scalars: List[Scalar]
    session_start: bool


def decode_event(data: bytes) -> Event:
    wall_time, step, version, values, start = 0.0, 0, None, [], False
    for field, _, value in _fields(data):
        if field == 1:
            (wall_time,) = struct.unpack("<d", value)
        elif field == 2:
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 3:
            version = value.decode()
        elif field == 5:
            values += [v for f, _, v in _fields(value) if f == 1]
        elif field == 7:
            start = any(f == 1 and v == _START for f, _, v in _fields(value))
    scalars = []
    for summary_value in values:
        tag, number = None, None
        for field, _, value in _fields(summary_value):
            if field == 1:
                tag = value.decode("utf-8")
            elif field == 2:
                (number,) = struct.unpack("<f", value)
        if tag is not None and number is not None:
            scalars.append(Scalar(step, tag, number, wall_time))
    return Event(wall_time, step, version, scalars, start)


def read_events(path: str) -> List[Event]:
    return [decode_event(data) for data in read_records(path)]
