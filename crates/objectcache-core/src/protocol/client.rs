//! The client side of a gather connection, sans-IO.

use super::descriptor::{GatherRequest, SaveRequest};
use super::frame::{
    decode_frame, decode_unit_prefix, ErrorCode, Frame, MissFrame, SaveDone, ServerInfo,
    UnitHeader, UnitTally, FRAME_HEADER_LEN, SAVE_DATA_HEADER_LEN, UNIT_PREFIX_LEN,
};
use super::frame::{encode_frame_header, FrameType};
use super::{ProtocolError, MAX_CONTROL_FRAME_BYTES, MAX_UNIT_BYTES, PREFACE, PROTOCOL_VERSION};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::collections::VecDeque;
use std::ops::Range;

/// What the server said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// The server's hello: gather is available with these limits.
    Connected(ServerInfo),
    /// The request was accepted: the units and payload bytes to come if nothing misses.
    Accepted(UnitTally),
    /// A unit whose CRC32C matched: copy `data` to layer `layer` at `offset`.
    Unit {
        /// Layer.
        layer: u32,
        /// Destination offset, bytes.
        offset: u64,
        /// Payload.
        data: Bytes,
    },
    /// Direct units only ([`ClientConnection::set_direct_units`]): a unit's header was
    /// checked and consumed; its `len` payload bytes come next on the stream, for the driver
    /// to read itself (straight into the destination, computing the CRC32C as they land),
    /// then to hand to [`ClientConnection::unit_end`]. No other frame is decoded until then.
    UnitBegin(UnitHeader),
    /// A unit whose CRC32C did not match: its layer is a miss.
    Corrupt {
        /// Layer.
        layer: u32,
        /// Destination offset of the unit.
        offset: u64,
        /// CRC in the frame.
        expected: u32,
        /// CRC computed over the payload.
        computed: u32,
    },
    /// Chunk `chunk`'s `layers` will not arrive.
    Miss(MissFrame),
    /// The gather finished: the units and payload bytes sent.
    End(UnitTally),
    /// A save was published.
    SaveDone(SaveDone),
    /// The server holds the request on purpose (admission queue, bandwidth pacing) and it is
    /// alive; only when the request asked for it ([`GatherRequest::held`]).
    Held {
        /// Request id.
        request_id: u64,
    },
    /// The request (or the connection, if [`ClientConnection::is_closed`]) failed.
    Error {
        /// Code.
        code: ErrorCode,
        /// Server's message.
        message: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Hello,
    Idle,
    Gathering,
    Saving,
    Closed,
}

/// Bounds of the gather in flight, to reject units outside the destination.
#[derive(Debug, Clone)]
struct Current {
    layers: Range<u32>,
    layer_bytes: u64,
    /// Per requested layer (index `layer - layers.start`): the offset its next unit must
    /// start at (units of a layer come in offset order, back to back), or `u64::MAX` once a
    /// miss named the layer (its later units skip the missing bytes).
    next: Vec<u64>,
    /// The request asked for `Held` frames.
    held: bool,
}

/// One gather connection, client side. [`ClientConnection::new`] queues the preface and
/// hello; wait for [`ClientEvent::Connected`] before starting a request.
#[derive(Debug)]
pub struct ClientConnection {
    state: State,
    info: Option<ServerInfo>,
    current: Option<Current>,
    events: VecDeque<ClientEvent>,
    transmit: VecDeque<Bytes>,
    /// Access key id and secret, to answer an authentication challenge.
    credentials: Option<(String, String)>,
    /// Units are announced by header ([`ClientEvent::UnitBegin`]), payload read by the driver.
    direct_units: bool,
    /// The direct unit whose payload the driver is reading.
    unit_in_progress: Option<UnitHeader>,
}

impl Default for ClientConnection {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientConnection {
    /// A new connection with the preface and hello queued, without credentials: a server
    /// that requires authentication refuses it ([`ErrorCode::Unauthorized`]).
    pub fn new() -> Self {
        Self::with_credentials(None)
    }

    /// A new connection that answers the server's authentication challenge (protocol
    /// version 2, see [`super::auth`]) with `(access_key_id, secret_key)`.
    pub fn with_credentials(credentials: Option<(String, String)>) -> Self {
        let mut b = BytesMut::with_capacity(16);
        b.put_slice(&PREFACE);
        Frame::Hello {
            version_min: PROTOCOL_VERSION,
            version_max: PROTOCOL_VERSION,
        }
        .encode(&mut b);
        ClientConnection {
            state: State::Hello,
            info: None,
            current: None,
            events: VecDeque::new(),
            transmit: VecDeque::from([b.freeze()]),
            credentials,
            direct_units: false,
            unit_in_progress: None,
        }
    }

    /// Chooses how units reach the driver. Off (the default): whole unit frames are buffered
    /// and checked here, and come out as [`ClientEvent::Unit`] (or [`ClientEvent::Corrupt`]).
    /// On: a unit's 32-byte prefix is decoded and checked here and comes out as
    /// [`ClientEvent::UnitBegin`]; the driver then reads the payload itself, first what is
    /// left in the buffer it passes to [`ClientConnection::handle_bytes`], then from its
    /// socket, so the bytes land in the destination with one copy (the kernel's), and calls
    /// [`ClientConnection::unit_end`] with the CRC32C it computed.
    pub fn set_direct_units(&mut self, on: bool) {
        self.direct_units = on;
    }

    /// Ends the direct unit announced by the last [`ClientEvent::UnitBegin`]: `computed` is
    /// the CRC32C of its payload as received. Returns `true` if it matches the unit's CRC
    /// (the bytes are good), `false` if not (the unit's layer is a miss).
    ///
    /// # Errors
    /// [`ProtocolError::UnexpectedFrame`] if no direct unit is in progress.
    pub fn unit_end(&mut self, computed: u32) -> Result<bool, ProtocolError> {
        match self.unit_in_progress.take() {
            Some(h) => Ok(h.crc32c == computed),
            None => Err(ProtocolError::UnexpectedFrame {
                frame: "Unit",
                state: "no direct unit in progress",
            }),
        }
    }

    /// The server's hello, once received.
    pub fn server_info(&self) -> Option<ServerInfo> {
        self.info
    }

    /// `true` when no request is in flight and the hello is done.
    pub fn is_idle(&self) -> bool {
        self.state == State::Idle
    }

    /// `true` once the connection failed.
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// Next bytes to write.
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        self.transmit.pop_front()
    }

    /// Next event.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// Queues a gather request.
    ///
    /// # Errors
    /// [`ProtocolError::UnexpectedFrame`] if not idle; the descriptor's own validation error;
    /// [`ProtocolError::TooLarge`] if it exceeds the server's announced limits.
    pub fn start_gather(&mut self, req: &GatherRequest) -> Result<(), ProtocolError> {
        let info = self.ready("Gather")?;
        req.validate(info.max_chunks)?;
        let rdma = match &req.target {
            super::TransportTarget::Rdma(t) => Some(t.is_contiguous()),
            _ => None,
        };
        // What the request asks for, the feature bit the server must announce for it, and
        // the error naming what is missing.
        let needs = [
            (
                rdma.is_some(),
                ServerInfo::FEATURE_RDMA,
                "transport target",
                "the server does not offer RDMA",
            ),
            (
                rdma == Some(false),
                ServerInfo::FEATURE_RDMA_SCATTER,
                "transport target",
                "the server does not accept RDMA targets with several segments per layer",
            ),
            (
                req.segments.is_some(),
                ServerInfo::FEATURE_SEGMENTS,
                "segment placement",
                "the server does not read segment objects (no Segments feature)",
            ),
            (
                req.held,
                ServerInfo::FEATURE_HELD,
                "held",
                "the server does not send Held frames (no Held feature)",
            ),
            (
                req.group.is_some(),
                ServerInfo::FEATURE_LOAD_GROUPS,
                "load group",
                "the server does not schedule striped loads as one (no load-group feature)",
            ),
        ];
        if let Some(&(_, _, what, why)) = needs
            .iter()
            .find(|&&(asked, feature, _, _)| asked && info.features & feature == 0)
        {
            return Err(ProtocolError::invalid(what, why));
        }
        let b = self.encode_control(&Frame::Gather(Box::new(req.clone())), info)?;
        self.transmit.push_back(b);
        self.current = Some(Current {
            layers: req.layers.clone(),
            layer_bytes: req.layer_bytes(),
            next: vec![0; req.layers.len()],
            held: req.held,
        });
        self.state = State::Gathering;
        Ok(())
    }

    /// Queues a save request; follow with [`ClientConnection::save_data`] for every object
    /// in chunk order, then [`ClientConnection::save_end`].
    ///
    /// # Errors
    /// As [`ClientConnection::start_gather`]; [`ProtocolError::Invalid`] if the server does not
    /// offer batched save.
    pub fn start_save(&mut self, req: &SaveRequest) -> Result<(), ProtocolError> {
        let info = self.ready("SaveBegin")?;
        if info.features & ServerInfo::FEATURE_SAVE == 0 {
            return Err(ProtocolError::invalid(
                "save",
                "the server does not offer batched save",
            ));
        }
        req.validate(info.max_chunks)?;
        let b = self.encode_control(&Frame::SaveBegin(Box::new(req.clone())), info)?;
        self.transmit.push_back(b);
        self.state = State::Saving;
        Ok(())
    }

    /// Queues save data: `data` (at most 16 MiB) at `offset` of chunk `chunk`'s object; the
    /// payload is sent as is (no copy).
    ///
    /// # Errors
    /// [`ProtocolError`] if no save is in progress or `data` is too large.
    pub fn save_data(&mut self, chunk: u32, offset: u64, data: Bytes) -> Result<(), ProtocolError> {
        if self.state != State::Saving {
            return Err(ProtocolError::UnexpectedFrame {
                frame: "SaveData",
                state: "not saving",
            });
        }
        if data.len() > MAX_UNIT_BYTES as usize {
            return Err(ProtocolError::TooLarge {
                what: "save data frame",
                got: data.len() as u64,
                max: MAX_UNIT_BYTES as u64,
            });
        }
        let mut h = BytesMut::with_capacity(FRAME_HEADER_LEN + SAVE_DATA_HEADER_LEN);
        encode_frame_header(
            FrameType::SaveData,
            (SAVE_DATA_HEADER_LEN + data.len()) as u32,
            &mut h,
        );
        h.put_u32_le(chunk);
        h.put_u32_le(0);
        h.put_u64_le(offset);
        self.transmit.push_back(h.freeze());
        self.transmit.push_back(data);
        Ok(())
    }

    /// Queues the end of save data.
    ///
    /// # Errors
    /// [`ProtocolError`] if no save is in progress.
    pub fn save_end(&mut self) -> Result<(), ProtocolError> {
        if self.state != State::Saving {
            return Err(ProtocolError::UnexpectedFrame {
                frame: "SaveEnd",
                state: "not saving",
            });
        }
        let mut b = BytesMut::new();
        Frame::SaveEnd.encode(&mut b);
        self.transmit.push_back(b.freeze());
        Ok(())
    }

    /// Queues a cancel of the request in flight (the server stops and answers `End` or
    /// `Error`; units already in flight may still arrive).
    pub fn cancel(&mut self, request_id: u64) {
        let mut b = BytesMut::new();
        Frame::Cancel { request_id }.encode(&mut b);
        self.transmit.push_back(b.freeze());
    }

    fn ready(&self, frame: &'static str) -> Result<ServerInfo, ProtocolError> {
        match (self.state, self.info) {
            (State::Idle, Some(i)) => Ok(i),
            (s, _) => Err(ProtocolError::UnexpectedFrame {
                frame,
                state: match s {
                    State::Hello => "awaiting the server's hello",
                    State::Closed => "closed",
                    _ => "a request is in flight",
                },
            }),
        }
    }

    fn encode_control(&self, f: &Frame, info: ServerInfo) -> Result<Bytes, ProtocolError> {
        let mut b = BytesMut::with_capacity(256);
        f.encode(&mut b);
        let body = (b.len() - FRAME_HEADER_LEN) as u64;
        let max = info.max_descriptor_bytes.min(MAX_CONTROL_FRAME_BYTES) as u64;
        if body > max {
            return Err(ProtocolError::TooLarge {
                what: "descriptor size",
                got: body,
                max,
            });
        }
        Ok(b.freeze())
    }

    /// Consumes whole frames from the front of `buf`.
    ///
    /// # Errors
    /// A protocol violation by the server (the connection is then closed).
    pub fn handle_bytes(&mut self, buf: &mut BytesMut) -> Result<(), ProtocolError> {
        let r = self.handle_inner(buf);
        if r.is_err() {
            self.state = State::Closed;
        }
        r
    }

    fn handle_inner(&mut self, buf: &mut BytesMut) -> Result<(), ProtocolError> {
        while self.state != State::Closed {
            if self.unit_in_progress.is_some() {
                // The driver is reading a direct unit's payload from this buffer.
                return Ok(());
            }
            if self.direct_units
                && self.state == State::Gathering
                && buf.first() == Some(&(FrameType::Unit as u8))
            {
                let Some(prefix) = buf.get(..UNIT_PREFIX_LEN) else {
                    return Ok(());
                };
                let h = decode_unit_prefix(prefix.try_into().expect("prefix length"))?;
                self.check_unit(&h)?;
                buf.advance(UNIT_PREFIX_LEN);
                self.unit_in_progress = Some(h);
                self.events.push_back(ClientEvent::UnitBegin(h));
                return Ok(());
            }
            let Some(f) = decode_frame(buf, MAX_CONTROL_FRAME_BYTES, u32::MAX)? else {
                return Ok(());
            };
            self.on_frame(f)?;
        }
        Ok(())
    }

    /// Checks a unit header against the gather in flight and advances its layer's expected
    /// offset: a unit outside the requested layers or bytes, or out of order, is refused.
    fn check_unit(&mut self, header: &UnitHeader) -> Result<(), ProtocolError> {
        let cur = self
            .current
            .as_ref()
            .expect("gathering has a current request");
        let end = header.offset.checked_add(header.len as u64);
        if !cur.layers.contains(&header.layer) || end.is_none_or(|e| e > cur.layer_bytes) {
            return Err(ProtocolError::invalid(
                "unit",
                format!(
                    "layer {} bytes {}..{} outside the request (layers {:?}, {} bytes per layer)",
                    header.layer,
                    header.offset,
                    header.offset as u128 + header.len as u128,
                    cur.layers,
                    cur.layer_bytes
                ),
            ));
        }
        // The unit CRC covers the payload only: a damaged layer or offset field would
        // put good bytes at the wrong place. Units of a layer come in offset order,
        // back to back (docs/protocol.md), so anything else is refused.
        let cur = self
            .current
            .as_mut()
            .expect("gathering has a current request");
        let next = &mut cur.next[(header.layer - cur.layers.start) as usize];
        if *next != u64::MAX {
            if header.offset != *next {
                return Err(ProtocolError::invalid(
                    "unit",
                    format!(
                        "layer {} unit at offset {}, expected the next at {}",
                        header.layer, header.offset, *next
                    ),
                ));
            }
            *next += header.len as u64;
        }
        Ok(())
    }

    fn on_frame(&mut self, f: Frame) -> Result<(), ProtocolError> {
        let st = self.state;
        let unexpected = |f: &Frame| ProtocolError::UnexpectedFrame {
            frame: f.ty().name(),
            state: match st {
                State::Hello => "awaiting hello",
                State::Idle => "idle",
                State::Gathering => "gathering",
                State::Saving => "saving",
                State::Closed => "closed",
            },
        };
        match (st, f) {
            (State::Hello, Frame::AuthChallenge { nonce }) => match &self.credentials {
                Some((ak, sk)) => {
                    let mut b = BytesMut::with_capacity(64 + ak.len());
                    Frame::Auth {
                        access_key: ak.clone(),
                        mac: super::auth::auth_mac(ak, sk, &nonce),
                    }
                    .encode(&mut b);
                    self.transmit.push_back(b.freeze());
                }
                None => {
                    self.state = State::Closed;
                    self.events.push_back(ClientEvent::Error {
                        code: ErrorCode::Unauthorized,
                        message: "the server requires authentication and this client has no \
                                  access key (give the store URL or config credentials)"
                            .into(),
                    });
                }
            },
            (State::Hello, Frame::HelloAck(i)) => {
                if i.version != PROTOCOL_VERSION {
                    return Err(ProtocolError::UnsupportedVersion {
                        min: i.version,
                        max: i.version,
                    });
                }
                self.info = Some(i);
                self.state = State::Idle;
                self.events.push_back(ClientEvent::Connected(i));
            }
            (State::Gathering, Frame::Accepted(t)) => {
                self.events.push_back(ClientEvent::Accepted(t));
            }
            (State::Gathering, Frame::Held { request_id })
                if self.current.as_ref().is_some_and(|c| c.held) =>
            {
                self.events.push_back(ClientEvent::Held { request_id });
            }
            (State::Gathering, Frame::Unit { header, data }) => {
                self.check_unit(&header)?;
                let computed = crate::layout::crc::crc32c(&data);
                if computed == header.crc32c {
                    self.events.push_back(ClientEvent::Unit {
                        layer: header.layer,
                        offset: header.offset,
                        data,
                    });
                } else {
                    self.events.push_back(ClientEvent::Corrupt {
                        layer: header.layer,
                        offset: header.offset,
                        expected: header.crc32c,
                        computed,
                    });
                }
            }
            (State::Gathering, Frame::Miss(m)) => {
                if let Some(cur) = self.current.as_mut() {
                    for l in m.layers.clone() {
                        if let Some(n) = l
                            .checked_sub(cur.layers.start)
                            .and_then(|i| cur.next.get_mut(i as usize))
                        {
                            *n = u64::MAX;
                        }
                    }
                }
                self.events.push_back(ClientEvent::Miss(m));
            }
            (State::Gathering, Frame::End(t)) => {
                self.state = State::Idle;
                self.current = None;
                self.events.push_back(ClientEvent::End(t));
            }
            (State::Saving, Frame::SaveDone(d)) => {
                self.state = State::Idle;
                self.events.push_back(ClientEvent::SaveDone(d));
            }
            (_, Frame::Error { code, message }) => {
                // Request-level errors leave the connection usable, except before the hello.
                self.state = if st == State::Hello {
                    State::Closed
                } else {
                    State::Idle
                };
                self.current = None;
                self.events.push_back(ClientEvent::Error { code, message });
            }
            (_, f) => return Err(unexpected(&f)),
        }
        Ok(())
    }
}
