//! Support for the dra-kubelet socket tests: a tiny scripted [`DraDriver`], short temp dirs, a server
//! starter, tonic channels over unix sockets, claims and a prepare call in the DRA protocol, and a raw HTTP/2 client that speaks exactly like
//! the kubelet's grpc-go client (percent-encoded `:authority`, Huffman, dynamic table).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use dra_kubelet::{
    ClaimRef, DeviceHealthReport, DraDriver, PluginServer, PluginServerConfig, PluginServing, PrepareOutcome,
    PreparedDevice, RegistrationState, UnprepareOutcome,
};
use loona_hpack::Decoder;
use migdra_proto::dra::{v1, v1beta1};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::UnixStream,
    sync::watch,
};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

pub const DRIVER: &str = "dra.example.com";
/// Guards every wait; never an assertion in itself.
pub const GUARD: Duration = Duration::from_secs(20);

/// A DraDriver scripted by claim UID prefix:
/// `ok-*` succeeds, `shared-*` succeeds with a share ID, `fail-*` fails, `missing-*` is left
/// out of the answer, `blank-*` fails with an empty message. It also answers an unrequested UID.
#[derive(Default)]
pub struct ScriptedDriver {
    pub prepare_calls: Mutex<Vec<Vec<ClaimRef>>>,
    pub unprepare_calls: Mutex<Vec<Vec<ClaimRef>>>,
}

pub fn device_for(uid: &str) -> PreparedDevice {
    PreparedDevice {
        request_names: vec!["req".to_string()],
        pool_name: "node-a".to_string(),
        device_name: format!("dev-{uid}"),
        cdi_device_ids: vec![format!("example.com/device={uid}")],
        share_id: uid.starts_with("shared-").then(|| format!("share-{uid}")),
    }
}

fn scripted<T>(claims: &[ClaimRef], ok: impl Fn(&ClaimRef) -> T) -> HashMap<String, Result<T, String>> {
    let mut out = HashMap::new();
    for claim in claims {
        let uid = claim.uid.as_str();
        if uid.starts_with("missing-") {
            continue;
        }
        let outcome = if uid.starts_with("fail-") {
            Err(format!("cannot do {uid}"))
        } else if uid.starts_with("blank-") {
            Err(String::new())
        } else {
            Ok(ok(claim))
        };
        out.insert(claim.uid.clone(), outcome);
    }
    if let Some(first) = claims.first() {
        out.insert("unrequested-uid".to_string(), Ok(ok(first)));
    }
    out
}

impl DraDriver for ScriptedDriver {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareOutcome> {
        self.prepare_calls.lock().expect("lock").push(claims.clone());
        scripted(&claims, |claim| vec![device_for(&claim.uid)])
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareOutcome> {
        self.unprepare_calls.lock().expect("lock").push(claims.clone());
        scripted(&claims, |_| ())
    }
}

pub fn claim(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".to_string(),
        uid: uid.to_string(),
        name: format!("claim-{uid}"),
    }
}

/// A temp dir directly under /tmp, so socket paths stay far below 108 bytes.
pub fn short_tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("md")
        .tempdir_in("/tmp")
        .expect("tempdir")
}

/// `claim(uid)` as the v1 DRA service takes it.
pub fn v1_claim(uid: &str) -> v1::Claim {
    let c = claim(uid);
    v1::Claim {
        namespace: c.namespace,
        uid: c.uid,
        name: c.name,
    }
}

/// `claim(uid)` as the v1beta1 DRA service takes it.
pub fn v1beta1_claim(uid: &str) -> v1beta1::Claim {
    let c = claim(uid);
    v1beta1::Claim {
        namespace: c.namespace,
        uid: c.uid,
        name: c.name,
    }
}

/// Prepares the claim `uid` through the v1 DRA service at `dra_socket`.
pub async fn prepare_one(dra_socket: &Path, uid: &str) -> v1::NodePrepareResourcesResponse {
    v1::dra_plugin_client::DraPluginClient::new(channel(dra_socket).await)
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim(uid)],
        })
        .await
        .expect("prepare")
        .into_inner()
}

/// A server for `config` (shutdown grace 5 s) driving `driver`, with no health reports and
/// nobody watching its registration.
pub fn plugin_server<D: DraDriver>(mut config: PluginServerConfig, driver: Arc<D>) -> PluginServer<D> {
    let (_health_tx, health) = watch::channel(Vec::new());
    let (registration, _registration_rx) = watch::channel(RegistrationState::default());
    config.shutdown_grace = Duration::from_secs(5);
    PluginServer::new(config, driver, health, registration)
}

/// Serves `server`'s DRA socket, then registers it.
pub async fn serve_registered<D: DraDriver>(
    server: PluginServer<D>,
    shutdown: CancellationToken,
) -> PluginServing {
    server
        .serve_dra(shutdown)
        .await
        .expect("serve DRA")
        .register()
        .await
        .expect("register")
}

/// Cancels `shutdown` and waits, within the guard, for `serving` to end cleanly.
pub async fn shut_down(shutdown: &CancellationToken, serving: PluginServing) {
    shutdown.cancel();
    tokio::time::timeout(GUARD, serving.wait())
        .await
        .expect("shutdown finished")
        .expect("clean shutdown");
}

/// A running plugin server with everything a test needs to drive and observe it.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub driver: Arc<ScriptedDriver>,
    pub health: watch::Sender<Vec<DeviceHealthReport>>,
    pub registration: watch::Receiver<RegistrationState>,
    pub shutdown: CancellationToken,
    pub serving: Option<PluginServing>,
    pub dra_socket: PathBuf,
    pub registration_socket: PathBuf,
}

impl Harness {
    pub async fn start(devices: Vec<DeviceHealthReport>, resend: Duration) -> Self {
        let dir = short_tempdir();
        let driver = Arc::new(ScriptedDriver::default());
        let (health, health_rx) = watch::channel(devices);
        let (registration_tx, registration) = watch::channel(RegistrationState::default());
        let mut config = PluginServerConfig::new(dir.path(), DRIVER);
        config.health_resend_interval = resend;
        config.shutdown_grace = Duration::from_secs(5);
        let shutdown = CancellationToken::new();
        let server = PluginServer::new(config, Arc::clone(&driver), health_rx, registration_tx);
        let serving = serve_registered(server, shutdown.clone()).await;
        Self {
            dra_socket: serving.dra_socket().to_path_buf(),
            registration_socket: serving.registration_socket().to_path_buf(),
            dir,
            driver,
            health,
            registration,
            shutdown,
            serving: Some(serving),
        }
    }

    /// Cancels and waits for the sockets to be removed.
    pub async fn stop(&mut self) {
        shut_down(&self.shutdown, self.serving.take().expect("still serving")).await;
    }
}

/// A tonic channel to a unix socket.
pub async fn channel(path: &Path) -> Channel {
    Endpoint::from_shared(format!("unix://{}", path.display()))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

// ---------------------------------------------------------------------------------------------
// A raw HTTP/2 client, as grpc-go's kubelet client would write the bytes.

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const CONTINUATION: u8 = 0x9;
pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const PADDED: u8 = 0x8;
pub const PRIORITY: u8 = 0x20;
pub const PROTOCOL_ERROR: u32 = 0x1;

/// The percent-encoding grpc-go applies to a bare socket path used as a target.
pub fn percent_encoded(path: &Path) -> String {
    path.display().to_string().replace('/', "%2F")
}

/// RFC 7541 Appendix B codes for the characters the tests Huffman-encode.
#[rustfmt::skip]
const HUFFMAN: &[(char, u32, u32)] = &[
    ('a', 0x3, 5), ('b', 0x23, 6), ('c', 0x4, 5), ('d', 0x24, 6), ('e', 0x5, 5), ('f', 0x25, 6),
    ('g', 0x26, 6), ('h', 0x27, 6), ('i', 0x6, 5), ('j', 0x74, 7), ('k', 0x75, 7), ('l', 0x28, 6),
    ('m', 0x29, 6), ('n', 0x2a, 6), ('o', 0x7, 5), ('p', 0x2b, 6), ('q', 0x76, 7), ('r', 0x2c, 6),
    ('s', 0x8, 5), ('t', 0x9, 5), ('u', 0x2d, 6), ('v', 0x77, 7), ('w', 0x78, 7), ('x', 0x79, 7),
    ('y', 0x7a, 7), ('z', 0x7b, 7), ('A', 0x21, 6), ('B', 0x5d, 7), ('C', 0x5e, 7), ('D', 0x5f, 7),
    ('E', 0x60, 7), ('F', 0x61, 7), ('G', 0x62, 7), ('H', 0x63, 7), ('I', 0x64, 7), ('J', 0x65, 7),
    ('K', 0x66, 7), ('L', 0x67, 7), ('M', 0x68, 7), ('N', 0x69, 7), ('O', 0x6a, 7), ('P', 0x6b, 7),
    ('Q', 0x6c, 7), ('R', 0x6d, 7), ('S', 0x6e, 7), ('T', 0x6f, 7), ('U', 0x70, 7), ('V', 0x71, 7),
    ('W', 0x72, 7), ('X', 0xfc, 8), ('Y', 0x73, 7), ('Z', 0xfd, 8), ('0', 0x0, 5), ('1', 0x1, 5),
    ('2', 0x2, 5), ('3', 0x19, 6), ('4', 0x1a, 6), ('5', 0x1b, 6), ('6', 0x1c, 6), ('7', 0x1d, 6),
    ('8', 0x1e, 6), ('9', 0x1f, 6), ('%', 0x15, 6), ('/', 0x18, 6), ('.', 0x17, 6), ('-', 0x16, 6),
    ('_', 0x22, 6), (':', 0x5c, 7),
];

pub fn huffman(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u64, 0u32);
    for c in text.chars() {
        let &(_, code, len) = HUFFMAN
            .iter()
            .find(|(ch, ..)| *ch == c)
            .expect("character in test table");
        acc = (acc << len) | u64::from(code);
        bits += len;
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        // Pad with the most significant bits of EOS (all ones).
        out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
    }
    out
}

/// An HPACK block builder with the representations grpc-go's encoder uses.
#[derive(Default)]
pub struct Block(pub Vec<u8>);

impl Block {
    fn integer(&mut self, flags: u8, prefix: u32, value: usize) {
        let limit = (1usize << prefix) - 1;
        if value < limit {
            self.0.push(flags | value as u8);
            return;
        }
        self.0.push(flags | limit as u8);
        let mut rest = value - limit;
        while rest >= 0x80 {
            self.0.push(0x80 | (rest & 0x7f) as u8);
            rest >>= 7;
        }
        self.0.push(rest as u8);
    }

    fn string(&mut self, text: &str, use_huffman: bool) {
        if use_huffman {
            let coded = huffman(text);
            self.integer(0x80, 7, coded.len());
            self.0.extend_from_slice(&coded);
        } else {
            self.integer(0, 7, text.len());
            self.0.extend_from_slice(text.as_bytes());
        }
    }

    /// Indexed header field (static or dynamic table).
    pub fn indexed(mut self, index: usize) -> Self {
        self.integer(0x80, 7, index);
        self
    }

    /// Literal with incremental indexing, name from the table.
    pub fn indexed_name(mut self, name_index: usize, value: &str, use_huffman: bool) -> Self {
        self.integer(0x40, 6, name_index);
        self.string(value, use_huffman);
        self
    }

    /// Literal with incremental indexing, new name.
    pub fn new_name(mut self, name: &str, value: &str, use_huffman: bool) -> Self {
        self.0.push(0x40);
        self.string(name, use_huffman);
        self.string(value, use_huffman);
        self
    }
}

/// The gRPC method the kubelet calls first on the registration socket.
pub const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";

/// The header block grpc-go sends for a call to `path` as the first call on a connection:
/// `:method POST` and `:scheme http` from the static table, the rest as literals that enter the
/// dynamic table (newest first afterwards: te=62, user-agent=63, content-type=64,
/// :authority=65, :path=66).
pub fn request_block(path: &str, authority: &str, use_huffman: bool) -> Vec<u8> {
    Block::default()
        .indexed(3) // :method POST
        .indexed(6) // :scheme http
        .indexed_name(4, path, use_huffman)
        .indexed_name(1, authority, use_huffman)
        .indexed_name(31, "application/grpc", use_huffman)
        .indexed_name(58, "grpc-go/1.72.2", use_huffman)
        .new_name("te", "trailers", use_huffman)
        .0
}

/// The first GetInfo header block grpc-go sends on a connection (see [`request_block`]).
pub fn get_info_block(authority: &str, use_huffman: bool) -> Vec<u8> {
    request_block(GET_INFO, authority, use_huffman)
}

/// The same request again, entirely from the dynamic table.
pub fn repeated_get_info_block() -> Vec<u8> {
    Block::default()
        .indexed(3)
        .indexed(6)
        .indexed(66)
        .indexed(65)
        .indexed(64)
        .indexed(63)
        .indexed(62)
        .0
}

/// A gRPC message frame body: uncompressed flag + big-endian length + message.
pub fn grpc_message(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&u32::try_from(message.len()).expect("small").to_be_bytes());
    out.extend_from_slice(message);
    out
}

pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("small").to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// What came back on one stream.
#[derive(Debug, Default)]
pub struct RawResponse {
    pub headers: Vec<(String, String)>,
    pub trailers: Vec<(String, String)>,
    pub data: Vec<u8>,
    pub reset: Option<u32>,
    pub goaway: Option<u32>,
    pub connection_closed: bool,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .chain(&self.trailers)
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The single gRPC message in the body.
    pub fn message(&self) -> &[u8] {
        assert!(self.data.len() >= 5, "no gRPC message in {self:?}");
        assert_eq!(self.data[0], 0, "compressed message");
        let len = u32::from_be_bytes(self.data[1..5].try_into().expect("4 bytes")) as usize;
        &self.data[5..5 + len]
    }
}

/// A kubelet-like HTTP/2 client connection.
pub struct RawClient {
    stream: UnixStream,
    decoder: Decoder<'static>,
    /// Response bytes received per stream and not yet taken as messages ([`Self::next_message`]).
    received: HashMap<u32, Vec<u8>>,
}

/// The header block fragment of a HEADERS or CONTINUATION payload (padding and priority removed).
fn header_fragment(kind: u8, flags: u8, payload: &[u8]) -> &[u8] {
    let mut fragment = payload;
    if kind == HEADERS {
        if flags & PADDED != 0 {
            let pad = usize::from(fragment[0]);
            fragment = &fragment[1..fragment.len() - pad];
        }
        if flags & PRIORITY != 0 {
            fragment = &fragment[5..];
        }
    }
    fragment
}

/// Takes one complete gRPC message off the front of `bytes`, if there is one.
fn take_message(bytes: &mut Vec<u8>) -> Option<Vec<u8>> {
    let header: [u8; 5] = bytes.get(..5)?.try_into().expect("5 bytes");
    assert_eq!(header[0], 0, "compressed message");
    let len = u32::from_be_bytes(header[1..].try_into().expect("4 bytes")) as usize;
    if bytes.len() < 5 + len {
        return None;
    }
    let message = bytes[5..5 + len].to_vec();
    bytes.drain(..5 + len);
    Some(message)
}

impl RawClient {
    /// Connects and sends the preface and an empty SETTINGS frame, like any HTTP/2 client.
    pub async fn connect(path: &Path) -> Self {
        let mut stream = UnixStream::connect(path).await.expect("connect");
        stream.write_all(PREFACE).await.expect("preface");
        stream
            .write_all(&frame(SETTINGS, 0, 0, &[]))
            .await
            .expect("settings");
        Self {
            stream,
            decoder: Decoder::new(),
            received: HashMap::new(),
        }
    }

    /// Starts a call to the gRPC method `path` with the given `:authority`, as grpc-go writes it
    /// (Huffman-coded literals), and sends `message` as the whole request.
    pub async fn request(&mut self, stream: u32, path: &str, authority: &str, message: &[u8]) {
        let mut bytes = frame(
            HEADERS,
            END_HEADERS,
            stream,
            &request_block(path, authority, true),
        );
        bytes.extend_from_slice(&frame(DATA, END_STREAM, stream, &grpc_message(message)));
        self.send(&bytes).await;
    }

    /// A unary call to `path` with the given `:authority`; returns the whole response.
    pub async fn call(&mut self, stream: u32, path: &str, authority: &str, message: &[u8]) -> RawResponse {
        self.request(stream, path, authority, message).await;
        tokio::time::timeout(GUARD, self.response(stream))
            .await
            .expect("response in time")
    }

    fn decode_headers(&mut self, block: &[u8]) -> Vec<(String, String)> {
        self.decoder
            .decode(block)
            .expect("server header block")
            .into_iter()
            .map(|(n, v)| {
                (
                    String::from_utf8_lossy(&n).into_owned(),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })
            .collect()
    }

    /// The next message of a streaming response on `stream`, bounded by the guard. Frames of
    /// other streams are kept for them; every header block is decoded, so that the HPACK state
    /// stays in step with the server. Panics when `stream` ends or the connection goes away.
    pub async fn next_message(&mut self, stream: u32) -> Vec<u8> {
        tokio::time::timeout(GUARD, async {
            let mut block = Vec::new();
            loop {
                if let Some(message) = take_message(self.received.entry(stream).or_default()) {
                    return message;
                }
                let (kind, flags, id, payload) = self.read_frame().await.expect("connection open");
                match kind {
                    SETTINGS if flags & ACK == 0 => self.send(&frame(SETTINGS, ACK, 0, &[])).await,
                    PING if flags & ACK == 0 => self.send(&frame(PING, ACK, 0, &payload)).await,
                    GOAWAY => panic!("connection closed by the server while waiting on stream {stream}"),
                    RST_STREAM if id == stream => panic!("stream {stream} reset: {payload:?}"),
                    HEADERS | CONTINUATION => {
                        block.extend_from_slice(header_fragment(kind, flags, &payload));
                        if flags & END_HEADERS != 0 {
                            let headers = self.decode_headers(&block);
                            block.clear();
                            assert!(
                                id != stream || kind != HEADERS || flags & END_STREAM == 0,
                                "stream {stream} ended: {headers:?}"
                            );
                        }
                    }
                    DATA => {
                        self.received.entry(id).or_default().extend_from_slice(&payload);
                        assert!(id != stream || flags & END_STREAM == 0, "stream {stream} ended");
                    }
                    _ => {}
                }
            }
        })
        .await
        .expect("message in time")
    }

    pub fn stream_mut(&mut self) -> &mut UnixStream {
        &mut self.stream
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send");
    }

    /// Sends one unary call: the given header frames, then the request message with END_STREAM.
    pub async fn unary(&mut self, stream: u32, header_frames: &[u8], message: &[u8]) -> RawResponse {
        let mut bytes = header_frames.to_vec();
        bytes.extend_from_slice(&frame(DATA, END_STREAM, stream, &grpc_message(message)));
        self.send(&bytes).await;
        tokio::time::timeout(GUARD, self.response(stream))
            .await
            .expect("response in time")
    }

    async fn read_frame(&mut self) -> Option<(u8, u8, u32, Vec<u8>)> {
        let mut header = [0u8; 9];
        self.stream.read_exact(&mut header).await.ok()?;
        let len = (usize::from(header[0]) << 16) | (usize::from(header[1]) << 8) | usize::from(header[2]);
        let stream = u32::from_be_bytes([header[5] & 0x7f, header[6], header[7], header[8]]);
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload).await.ok()?;
        Some((header[3], header[4], stream, payload))
    }

    /// Reads until `stream` ends, is reset, or the connection goes away; answers SETTINGS and
    /// PING as a client must.
    pub async fn response(&mut self, stream: u32) -> RawResponse {
        let mut response = RawResponse::default();
        let mut block = Vec::new();
        let mut block_ends_stream = false;
        loop {
            let Some((kind, flags, id, payload)) = self.read_frame().await else {
                response.connection_closed = true;
                return response;
            };
            match kind {
                SETTINGS if flags & ACK == 0 => self.send(&frame(SETTINGS, ACK, 0, &[])).await,
                PING if flags & ACK == 0 => self.send(&frame(PING, ACK, 0, &payload)).await,
                GOAWAY => {
                    response.goaway = Some(u32::from_be_bytes(payload[4..8].try_into().expect("code")));
                    return response;
                }
                RST_STREAM if id == stream => {
                    response.reset = Some(u32::from_be_bytes(payload[..4].try_into().expect("code")));
                    return response;
                }
                HEADERS | CONTINUATION if id == stream => {
                    if kind == HEADERS {
                        block_ends_stream = flags & END_STREAM != 0;
                    }
                    block.extend_from_slice(header_fragment(kind, flags, &payload));
                    if flags & END_HEADERS != 0 {
                        let decoded = self.decode_headers(&block);
                        block.clear();
                        if response.headers.is_empty() {
                            response.headers = decoded;
                        } else {
                            response.trailers = decoded;
                        }
                        if block_ends_stream {
                            return response;
                        }
                    }
                }
                DATA if id == stream => {
                    response.data.extend_from_slice(&payload);
                    if flags & END_STREAM != 0 {
                        return response;
                    }
                }
                _ => {}
            }
        }
    }

    /// Reads until the peer closes the connection (true) or sends GOAWAY (false).
    pub async fn closed_by_peer(&mut self) -> bool {
        loop {
            match self.read_frame().await {
                None => return true,
                Some((GOAWAY, ..)) => return false,
                Some(_) => {}
            }
        }
    }
}
