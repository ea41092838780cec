//! The server side of a gather connection, sans-IO.

use super::descriptor::{GatherRequest, SaveRequest};
use super::frame::{decode_frame, ErrorCode, Frame, FrameType, ServerInfo, UnitHeader};
use super::frame::{MissFrame, SaveData, SaveDone, UnitTally, FRAME_HEADER_LEN};
use super::{ProtocolError, MAX_CONTROL_FRAME_BYTES, PREFACE, PROTOCOL_VERSION};
use bytes::{Bytes, BytesMut};
use std::collections::VecDeque;

/// Largest frame body a client may send before it is authenticated, bytes: an `Auth` frame
/// (a 2-byte length, an access key id of at most [`super::auth::MAX_ACCESS_KEY_LEN`] bytes,
/// the MAC). A `Hello` is 4 bytes. A larger header before authentication closes the
/// connection at once, before any of its body is read or buffered.
pub const MAX_HANDSHAKE_BODY_BYTES: u32 =
    (2 + super::auth::MAX_ACCESS_KEY_LEN + super::auth::MAC_LEN) as u32;

/// Limits a server announces in its hello and enforces on every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest descriptor body, bytes (at most 16 MiB).
    pub max_descriptor_bytes: u32,
    /// Most chunks per request.
    pub max_chunks: u32,
    /// Most bytes one request may hold in server memory.
    pub max_request_bytes: u64,
    /// Feature bits ([`ServerInfo::FEATURE_GATHER_TCP`], ...).
    pub features: u32,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_descriptor_bytes: 1 << 20,
            max_chunks: 4096,
            max_request_bytes: 256 << 20,
            features: ServerInfo::FEATURE_GATHER_TCP
                | ServerInfo::FEATURE_SAVE
                | ServerInfo::FEATURE_LOAD_GROUPS
                | ServerInfo::FEATURE_HELD
                | ServerInfo::FEATURE_SEGMENTS,
        }
    }
}

/// What the client asked for; the driver acts on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// Serve this gather: call [`ServerConnection::accept`], then send units, then
    /// [`ServerConnection::finish`] (or [`ServerConnection::fail`]).
    Gather(Box<GatherRequest>),
    /// A batched save begins.
    SaveBegin(Box<SaveRequest>),
    /// Save data for chunk `chunk` at byte `offset` of its object.
    SaveData(SaveData),
    /// All save data sent: publish, then [`ServerConnection::save_done`].
    SaveEnd,
    /// The client cancelled the request in flight: stop sending and free its resources.
    Cancel {
        /// Request id.
        request_id: u64,
    },
    /// The connection failed with this protocol error; an `Error` frame is queued and the
    /// driver flushes it and closes.
    Failed(ProtocolError),
    /// The client answered the authentication challenge (version 2): look up the secret of
    /// `access_key` and call [`ServerConnection::authenticate`].
    Authenticate {
        /// Access key id the client claims.
        access_key: String,
        /// Its HMAC of the nonce ([`super::auth::auth_mac`]).
        mac: [u8; super::auth::MAC_LEN],
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Preface,
    Hello,
    Auth,
    Idle,
    Gathering,
    Saving,
    Publishing,
    Closed,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Preface => "awaiting preface",
            State::Hello => "awaiting hello",
            State::Auth => "awaiting authentication",
            State::Idle => "idle",
            State::Gathering => "gathering",
            State::Saving => "receiving save data",
            State::Publishing => "publishing",
            State::Closed => "closed",
        }
    }
}

/// One gather connection, server side: `handle_bytes` / `poll_event` / `poll_transmit`, plus
/// commands (`accept`, `send_unit`, `send_miss`, `finish`, `fail`, `save_done`) that queue
/// frames. Requests on one connection are sequential.
#[derive(Debug)]
pub struct ServerConnection {
    limits: ServerLimits,
    state: State,
    events: VecDeque<ServerEvent>,
    transmit: VecDeque<Bytes>,
    /// Set when the connection must authenticate: the nonce sent in the challenge.
    nonce: Option<[u8; super::auth::NONCE_LEN]>,
}

/// Maps a decode error to the code the client sees.
fn code_of(e: &ProtocolError) -> ErrorCode {
    match e {
        ProtocolError::TooLarge {
            what: "descriptor size",
            ..
        } => ErrorCode::DescriptorTooLarge,
        ProtocolError::TooLarge {
            what: "chunks per request",
            ..
        } => ErrorCode::TooManyChunks,
        ProtocolError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
        _ => ErrorCode::Malformed,
    }
}

impl ServerConnection {
    /// A new connection awaiting the client's preface.
    pub fn new(limits: ServerLimits) -> Self {
        let mut limits = limits;
        limits.max_descriptor_bytes = limits.max_descriptor_bytes.min(MAX_CONTROL_FRAME_BYTES);
        ServerConnection {
            limits,
            state: State::Preface,
            events: VecDeque::new(),
            transmit: VecDeque::new(),
            nonce: None,
        }
    }

    /// A new connection that must authenticate before anything else: after the hello the
    /// server sends `nonce` (fresh random bytes from the driver) in an `AuthChallenge`, and
    /// answers the client's `Auth` with [`ServerEvent::Authenticate`].
    pub fn with_auth(limits: ServerLimits, nonce: [u8; super::auth::NONCE_LEN]) -> Self {
        let mut c = Self::new(limits);
        c.nonce = Some(nonce);
        c
    }

    /// Completes the authentication reported by [`ServerEvent::Authenticate`]: `secret` is
    /// the configured secret of the claimed access key (`None`: unknown key). On success the
    /// `HelloAck` is queued and requests are accepted; otherwise an `Unauthorized` error is
    /// queued and the connection closes. Returns whether the client was authenticated.
    pub fn authenticate(
        &mut self,
        access_key: &str,
        mac: &[u8; super::auth::MAC_LEN],
        secret: Option<&str>,
    ) -> bool {
        let ok = match (self.state, self.nonce, secret) {
            (State::Auth, Some(n), Some(sk)) => super::auth::verify_mac(access_key, sk, &n, mac),
            _ => false,
        };
        if ok {
            self.hello_ack(ServerInfo::FEATURE_AUTH);
            self.state = State::Idle;
        } else {
            self.close_with(
                ErrorCode::Unauthorized,
                &format!(
                    "gather authentication failed: access key {access_key:?} is unknown or its \
                     HMAC does not match"
                ),
            );
        }
        ok
    }

    fn hello_ack(&mut self, extra_features: u32) {
        self.queue(Frame::HelloAck(ServerInfo {
            version: PROTOCOL_VERSION,
            features: self.limits.features | extra_features,
            max_descriptor_bytes: self.limits.max_descriptor_bytes,
            max_chunks: self.limits.max_chunks,
            max_request_bytes: self.limits.max_request_bytes,
        }));
    }

    /// `true` once the connection failed or the client's hello was refused: flush
    /// [`ServerConnection::poll_transmit`] and close.
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// `true` while a gather or save is in progress.
    pub fn is_busy(&self) -> bool {
        matches!(
            self.state,
            State::Gathering | State::Saving | State::Publishing
        )
    }

    /// Consumes whole frames from the front of `buf` (leaving a partial frame there).
    ///
    /// # Errors
    /// The protocol error that closed the connection (also reported as
    /// [`ServerEvent::Failed`], with an `Error` frame queued for the client).
    pub fn handle_bytes(&mut self, buf: &mut BytesMut) -> Result<(), ProtocolError> {
        if let Err(e) = self.handle_inner(buf) {
            self.queue_error(code_of(&e), &e.to_string());
            self.events.push_back(ServerEvent::Failed(e.clone()));
            self.state = State::Closed;
            buf.clear();
            return Err(e);
        }
        Ok(())
    }

    fn handle_inner(&mut self, buf: &mut BytesMut) -> Result<(), ProtocolError> {
        loop {
            match self.state {
                State::Closed => return Ok(()),
                State::Preface => {
                    let n = buf.len().min(PREFACE.len());
                    if buf[..n] != PREFACE[..n] {
                        return Err(ProtocolError::BadPreface);
                    }
                    if n < PREFACE.len() {
                        return Ok(());
                    }
                    let _ = buf.split_to(PREFACE.len());
                    self.state = State::Hello;
                }
                _ => {
                    self.screen(buf)?;
                    let Some(f) = decode_frame(
                        buf,
                        self.limits.max_descriptor_bytes,
                        self.limits.max_chunks,
                    )?
                    else {
                        return Ok(());
                    };
                    self.on_frame(f)?;
                }
            }
        }
    }

    /// Whether a client frame of type `ty` may arrive in the current state.
    fn admits(&self, ty: FrameType) -> bool {
        use FrameType as T;
        match self.state {
            State::Hello => ty == T::Hello,
            State::Auth => ty == T::Auth,
            State::Idle => matches!(ty, T::Gather | T::SaveBegin | T::Cancel),
            State::Gathering | State::Publishing => ty == T::Cancel,
            State::Saving => matches!(ty, T::SaveData | T::SaveEnd | T::Cancel),
            State::Preface | State::Closed => false,
        }
    }

    /// Checks the header of the frame at the front of `buf` (once its 8 bytes are there)
    /// against the state, before any of its body is buffered: a frame type the state does
    /// not accept, or a body above [`MAX_HANDSHAKE_BODY_BYTES`] before authentication, fails
    /// the connection at once (so an unauthenticated client cannot make the server hold more
    /// than a few hundred bytes, nor an authenticated one a 16 MiB frame it will refuse).
    fn screen(&self, buf: &[u8]) -> Result<(), ProtocolError> {
        if buf.len() < FRAME_HEADER_LEN {
            return Ok(());
        }
        let ty = FrameType::from_u8(buf[0])?;
        if !self.admits(ty) {
            return Err(ProtocolError::UnexpectedFrame {
                frame: ty.name(),
                state: self.state.name(),
            });
        }
        if matches!(self.state, State::Hello | State::Auth) {
            let len = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
            if len > MAX_HANDSHAKE_BODY_BYTES {
                return Err(ProtocolError::TooLarge {
                    what: "frame body before authentication",
                    got: len as u64,
                    max: MAX_HANDSHAKE_BODY_BYTES as u64,
                });
            }
        }
        Ok(())
    }

    /// Bytes (header and body) of the frame whose header is at the front of `buf`, when only
    /// part of it has arrived; `None` when `buf` holds no frame header, or a whole frame.
    /// Drivers use it to account a large frame (a descriptor, save data) against their
    /// memory budget before reading its body.
    pub fn partial_frame_len(&self, buf: &[u8]) -> Option<usize> {
        if matches!(self.state, State::Preface | State::Closed) || buf.len() < FRAME_HEADER_LEN {
            return None;
        }
        let len = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes")) as usize;
        let total = FRAME_HEADER_LEN + len;
        (buf.len() < total).then_some(total)
    }

    /// `true` once the client's hello (and, with access keys, its authentication) was
    /// accepted: requests may follow.
    pub fn is_established(&self) -> bool {
        !matches!(
            self.state,
            State::Preface | State::Hello | State::Auth | State::Closed
        )
    }

    /// `true` while the connection waits for the client's next request.
    pub fn is_idle(&self) -> bool {
        self.state == State::Idle
    }

    fn on_frame(&mut self, f: Frame) -> Result<(), ProtocolError> {
        let unexpected = |f: &Frame, s: State| ProtocolError::UnexpectedFrame {
            frame: f.ty().name(),
            state: s.name(),
        };
        match (self.state, f) {
            (
                State::Hello,
                Frame::Hello {
                    version_min,
                    version_max,
                },
            ) => {
                if !(version_min..=version_max).contains(&PROTOCOL_VERSION) {
                    return Err(ProtocolError::UnsupportedVersion {
                        min: version_min,
                        max: version_max,
                    });
                }
                match self.nonce {
                    Some(nonce) => {
                        self.queue(Frame::AuthChallenge { nonce });
                        self.state = State::Auth;
                    }
                    None => {
                        self.hello_ack(0);
                        self.state = State::Idle;
                    }
                }
            }
            (State::Auth, Frame::Auth { access_key, mac }) => {
                self.events
                    .push_back(ServerEvent::Authenticate { access_key, mac });
            }
            (State::Idle, Frame::Gather(g)) => {
                if g.held && self.limits.features & ServerInfo::FEATURE_HELD == 0 {
                    return Err(ProtocolError::invalid(
                        "flags",
                        "bit 3 (Held frames) needs the Held feature, which this server does not announce",
                    ));
                }
                if g.group.is_some() && self.limits.features & ServerInfo::FEATURE_LOAD_GROUPS == 0
                {
                    return Err(ProtocolError::invalid(
                        "flags",
                        "bit 2 (load group) needs the load-group feature, which this server does not announce",
                    ));
                }
                if g.segments.is_some() && self.limits.features & ServerInfo::FEATURE_SEGMENTS == 0
                {
                    return Err(ProtocolError::invalid(
                        "flags",
                        "bit 4 (segment placement) needs the Segments feature, which this server does not announce",
                    ));
                }
                self.state = State::Gathering;
                self.events.push_back(ServerEvent::Gather(g));
            }
            (State::Idle, Frame::SaveBegin(s)) => {
                self.state = State::Saving;
                self.events.push_back(ServerEvent::SaveBegin(s));
            }
            (State::Saving, Frame::SaveData(d)) => {
                self.events.push_back(ServerEvent::SaveData(d));
            }
            (State::Saving, Frame::SaveEnd) => {
                self.state = State::Publishing;
                self.events.push_back(ServerEvent::SaveEnd);
            }
            // A cancel may race with the end of its request: ignore it when idle.
            (State::Idle, Frame::Cancel { .. }) => {}
            (
                State::Gathering | State::Saving | State::Publishing,
                Frame::Cancel { request_id },
            ) => {
                self.events.push_back(ServerEvent::Cancel { request_id });
            }
            (s, f) => return Err(unexpected(&f, s)),
        }
        Ok(())
    }

    /// Next event for the driver.
    pub fn poll_event(&mut self) -> Option<ServerEvent> {
        self.events.pop_front()
    }

    /// Next bytes to write to the socket, in order. Unit payloads come out as the very
    /// `Bytes` handed to [`ServerConnection::send_unit`] (no copy).
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        self.transmit.pop_front()
    }

    /// Bytes queued for transmission.
    pub fn queued_bytes(&self) -> usize {
        self.transmit.iter().map(Bytes::len).sum()
    }

    fn queue(&mut self, f: Frame) {
        let mut b = BytesMut::with_capacity(64);
        f.encode(&mut b);
        self.transmit.push_back(b.freeze());
    }

    /// Queues an `Error` frame: `code` and its human-readable `message`.
    fn queue_error(&mut self, code: ErrorCode, message: &str) {
        self.queue(Frame::Error {
            code,
            message: message.to_string(),
        });
    }

    /// Acknowledges the gather in progress: `units` units, `bytes` payload bytes.
    pub fn accept(&mut self, request_id: u64, units: u64, bytes: u64) {
        self.queue(Frame::Accepted(UnitTally {
            request_id,
            units,
            bytes,
        }));
    }

    /// Queues a unit whose payload is the concatenation of `parts` (each sent as is).
    /// `header.len` must equal the parts' total length.
    pub fn send_unit(&mut self, header: UnitHeader, parts: impl IntoIterator<Item = Bytes>) {
        self.transmit
            .push_back(Bytes::copy_from_slice(&header.encode_prefix()));
        self.transmit.extend(parts);
    }

    /// Queues a miss: chunk `m.chunk`'s `m.layers` will not be delivered.
    pub fn send_miss(&mut self, m: MissFrame) {
        self.queue(Frame::Miss(m));
    }

    /// Tells the client that the gather in progress is held on purpose and alive (waiting
    /// for admission or for its bandwidth share). Send only when the request asked for it
    /// ([`GatherRequest::held`]); at least every [`super::HELD_EVERY_MS`] ms of holding.
    pub fn send_held(&mut self, request_id: u64) {
        self.queue(Frame::Held { request_id });
    }

    /// Ends the gather in progress; the connection accepts a next request.
    pub fn finish(&mut self, request_id: u64, units: u64, bytes: u64) {
        self.queue(Frame::End(UnitTally {
            request_id,
            units,
            bytes,
        }));
        self.state = State::Idle;
    }

    /// Fails the request in progress (or refuses one) with `code`; the connection accepts a
    /// next request.
    pub fn fail(&mut self, code: ErrorCode, message: &str) {
        self.queue_error(code, message);
        if self.state != State::Closed {
            self.state = State::Idle;
        }
    }

    /// Refuses the request and closes the connection after flushing (e.g. shutting down).
    pub fn close_with(&mut self, code: ErrorCode, message: &str) {
        self.queue_error(code, message);
        self.state = State::Closed;
    }

    /// Reports a published save.
    pub fn save_done(&mut self, request_id: u64, written: u32, already_present: u32) {
        self.queue(Frame::SaveDone(SaveDone {
            request_id,
            written,
            already_present,
        }));
        self.state = State::Idle;
    }
}
