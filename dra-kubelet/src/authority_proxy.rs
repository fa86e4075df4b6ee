//! An HTTP/2 proxy in front of the kubelet-facing gRPC servers that rewrites `:authority`.
//!
//! The kubelet dials the registration socket (and, before 1.34, the DRA socket) by its bare
//! path, so grpc-go sends the percent-encoded socket path as `:authority`, which the `h2` crate
//! under tonic refuses with PROTOCOL_ERROR. The proxy decodes every client header block
//! (HEADERS + CONTINUATION, PADDED and PRIORITY handled) with its own HPACK decoder, sets
//! `:authority` to `localhost`, re-encodes the block and hands the connection to tonic through
//! an in-memory pipe; everything else passes unchanged in both directions.
//!
//! Re-encoded blocks use only literals without indexing, so the server's HPACK decoder never
//! gains a dynamic-table entry, and are split into frames of at most 16 384 bytes (the smallest
//! SETTINGS_MAX_FRAME_SIZE a peer may announce), so the server's settings need not be tracked.
//! Any malformed input closes the connection; buffers are bounded per connection.

use std::{
    pin::{Pin, pin},
    task::{Context, Poll},
    time::Duration,
};

use futures::Stream;
use loona_hpack::Decoder;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream},
    net::{UnixListener, UnixStream},
    sync::mpsc,
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::SocketKind;

const CLIENT_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const REWRITTEN_AUTHORITY: &[u8] = b"localhost";

/// Largest encoded header block (all HEADERS/CONTINUATION payloads of one block) accepted.
const MAX_HEADER_BLOCK: usize = 64 * 1024;

/// Largest decoded header list accepted, counted as in SETTINGS_MAX_HEADER_LIST_SIZE (name +
/// value + 32 per field); bounds what indexed references can expand to.
const MAX_HEADER_LIST: usize = 256 * 1024;

/// Largest dynamic table the client's encoder may ask our decoder for.
const MAX_DECODER_TABLE: usize = 64 * 1024;

/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may announce (RFC 9113 §6.5.2).
const MIN_MAX_FRAME_SIZE: usize = 16_384;

const FRAME_HEADER_LEN: usize = 9;
const PRIORITY_LEN: usize = 5;
const DUPLEX_BUFFER: usize = 64 * 1024;
const PENDING_CONNECTIONS: usize = 16;
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

const TYPE_HEADERS: u8 = 0x1;
const TYPE_PUSH_PROMISE: u8 = 0x5;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;

/// Why a proxied connection was closed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("client did not send the HTTP/2 connection preface")]
    BadPreface,
    #[error("HTTP/2 protocol error from client: {0}")]
    Protocol(&'static str),
    /// Beyond [`MAX_HEADER_BLOCK`] or [`MAX_HEADER_LIST`].
    #[error("header block too large")]
    HeaderBlockTooLarge,
    #[error("HPACK decoding failed: {0}")]
    Hpack(#[from] loona_hpack::decoder::DecoderError),
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl ProxyError {
    /// True when the peer simply went away (reset, broken pipe), as the kubelet ends a
    /// registration connection.
    fn is_disconnect(&self) -> bool {
        matches!(self, ProxyError::Io(e) if matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
        ))
    }
}

/// The server ends of proxied connections, to be fed to
/// `tonic::transport::Server::serve_with_incoming_shutdown`. Ends when the proxy stops.
pub struct ProxiedConnections {
    connections: mpsc::Receiver<DuplexStream>,
}

impl Stream for ProxiedConnections {
    type Item = std::io::Result<DuplexStream>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.connections
            .poll_recv(cx)
            .map(|connection| connection.map(Ok))
    }
}

/// Accepts connections on one kubelet socket and proxies each one (one task per connection) into
/// a [`ProxiedConnections`] stream.
pub struct AuthorityProxy {
    kind: SocketKind,
    listener: UnixListener,
    connections: mpsc::Sender<DuplexStream>,
}

impl AuthorityProxy {
    /// A proxy for `listener` (`kind` names it in logs) and the connections it produces.
    pub fn new(kind: SocketKind, listener: UnixListener) -> (Self, ProxiedConnections) {
        let (sender, receiver) = mpsc::channel(PENDING_CONNECTIONS);
        (
            Self {
                kind,
                listener,
                connections: sender,
            },
            ProxiedConnections {
                connections: receiver,
            },
        )
    }

    /// Accepts until `shutdown` is cancelled or the server stops taking connections, then waits
    /// for the open connections to end (the server closes them when it shuts down). Dropping the
    /// returned future aborts every connection.
    pub async fn run(self, shutdown: CancellationToken) {
        let Self {
            kind,
            listener,
            connections: to_server,
        } = self;
        let mut open = JoinSet::new();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(_) = open.join_next(), if !open.is_empty() => {}
                accepted = listener.accept() => match accepted {
                    Ok((client, _)) => {
                        let (near, far) = tokio::io::duplex(DUPLEX_BUFFER);
                        if to_server.send(far).await.is_err() {
                            debug!(%kind, "server stopped taking connections");
                            break;
                        }
                        open.spawn(async move {
                            match proxy_connection(client, near).await {
                                Ok(()) => debug!(%kind, "connection closed"),
                                // The kubelet drops its registration connection right after
                                // registering; a reset or broken pipe is normal, anything else not.
                                Err(error) if error.is_disconnect() => debug!(%kind, %error, "connection closed by the peer"),
                                Err(error) => warn!(%kind, %error, "connection closed"),
                            }
                        });
                    }
                    Err(error) => {
                        // Typically EMFILE: back off instead of spinning.
                        warn!(%kind, %error, "accepting a connection failed");
                        tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    }
                },
            }
        }
        // Ends the server's incoming stream.
        drop(to_server);
        drop(listener);
        while open.join_next().await.is_some() {}
    }
}

/// Proxies one client connection to the server end `server` until either side is done.
pub async fn proxy_connection(client: UnixStream, server: DuplexStream) -> Result<(), ProxyError> {
    let (client_read, mut client_write) = client.into_split();
    let (server_read, server_write) = tokio::io::split(server);
    let mut upstream = pin!(client_to_server(client_read, server_write));
    let mut downstream = pin!(async move {
        let mut server_read = server_read;
        tokio::io::copy(&mut server_read, &mut client_write).await?;
        client_write.shutdown().await?;
        Ok::<(), ProxyError>(())
    });
    tokio::select! {
        // The client is done sending: let the server finish its answers.
        result = &mut upstream => {
            result?;
            downstream.await
        }
        // The server closed the connection: nothing more can be answered.
        result = &mut downstream => result,
    }
}

/// A header block being collected from HEADERS + CONTINUATION frames.
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; PRIORITY_LEN]>,
    fragment: Vec<u8>,
}

struct FrameHeader {
    length: usize,
    kind: u8,
    flags: u8,
    stream_id: u32,
}

impl FrameHeader {
    fn parse(bytes: &[u8; FRAME_HEADER_LEN]) -> Self {
        Self {
            length: usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]),
            kind: bytes[3],
            flags: bytes[4],
            stream_id: u32::from_be_bytes([bytes[5] & 0x7f, bytes[6], bytes[7], bytes[8]]),
        }
    }
}

/// Reads a frame header; `None` on a clean end of stream at a frame boundary.
async fn read_frame_header<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Option<FrameHeader>, ProxyError> {
    let mut bytes = [0u8; FRAME_HEADER_LEN];
    if reader.read(&mut bytes[..1]).await? == 0 {
        return Ok(None);
    }
    fill(reader, &mut bytes[1..]).await?;
    Ok(Some(FrameHeader::parse(&bytes)))
}

async fn read_payload<R: AsyncRead + Unpin>(reader: &mut R, length: usize) -> Result<Vec<u8>, ProxyError> {
    let mut payload = vec![0u8; length];
    fill(reader, &mut payload).await?;
    Ok(payload)
}

/// `read_exact`, with an early end of stream as [`ProxyError::Truncated`].
async fn fill<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> Result<(), ProxyError> {
    match reader.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => Err(ProxyError::Truncated),
        Err(error) => Err(error.into()),
    }
}

/// Client-to-server direction: checks the preface, rewrites header blocks, copies other frames.
async fn client_to_server<R, W>(mut client: R, mut server: W) -> Result<(), ProxyError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; CLIENT_PREFACE.len()];
    match client.read_exact(&mut preface).await {
        Ok(_) => {}
        // A connect-and-close (e.g. a liveness probe) is not an error.
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
        Err(error) => return Err(error.into()),
    }
    if &preface != CLIENT_PREFACE {
        return Err(ProxyError::BadPreface);
    }
    server.write_all(CLIENT_PREFACE).await?;

    let mut rewriter = HeaderRewriter::new();
    let mut pending: Option<PendingBlock> = None;
    let mut encoded = Vec::new();
    while let Some(frame) = read_frame_header(&mut client).await? {
        match (frame.kind, pending.as_mut()) {
            (TYPE_HEADERS, None) => {
                if frame.length > MAX_HEADER_BLOCK + PRIORITY_LEN + 256 {
                    return Err(ProxyError::HeaderBlockTooLarge);
                }
                let payload = read_payload(&mut client, frame.length).await?;
                let (priority, fragment) = split_headers_payload(frame.flags, &payload)?;
                if fragment.len() > MAX_HEADER_BLOCK {
                    return Err(ProxyError::HeaderBlockTooLarge);
                }
                let block = PendingBlock {
                    stream_id: frame.stream_id,
                    end_stream: frame.flags & FLAG_END_STREAM != 0,
                    priority,
                    fragment: fragment.to_vec(),
                };
                if frame.flags & FLAG_END_HEADERS != 0 {
                    rewriter.rewrite(&block, &mut encoded)?;
                    server.write_all(&encoded).await?;
                } else {
                    pending = Some(block);
                }
            }
            (TYPE_CONTINUATION, Some(block)) if block.stream_id == frame.stream_id => {
                if block.fragment.len() + frame.length > MAX_HEADER_BLOCK {
                    return Err(ProxyError::HeaderBlockTooLarge);
                }
                let payload = read_payload(&mut client, frame.length).await?;
                block.fragment.extend_from_slice(&payload);
                if frame.flags & FLAG_END_HEADERS != 0 {
                    rewriter.rewrite(block, &mut encoded)?;
                    server.write_all(&encoded).await?;
                    pending = None;
                }
            }
            (_, Some(_)) => return Err(ProxyError::Protocol("header block interrupted by another frame")),
            (TYPE_CONTINUATION, None) => {
                return Err(ProxyError::Protocol("CONTINUATION without an open header block"));
            }
            // A client must not push; its header block would also desynchronise our decoder.
            (TYPE_PUSH_PROMISE, None) => return Err(ProxyError::Protocol("PUSH_PROMISE from a client")),
            (_, None) => {
                let mut header = Vec::with_capacity(FRAME_HEADER_LEN);
                push_frame_header(
                    &mut header,
                    frame.length,
                    frame.kind,
                    frame.flags,
                    frame.stream_id,
                );
                server.write_all(&header).await?;
                let length = u64::try_from(frame.length).map_err(|_| ProxyError::Truncated)?;
                let copied = tokio::io::copy(&mut (&mut client).take(length), &mut server).await?;
                if copied != length {
                    return Err(ProxyError::Truncated);
                }
            }
        }
    }
    if pending.is_some() {
        return Err(ProxyError::Truncated);
    }
    server.shutdown().await?;
    Ok(())
}

/// Strips padding and the priority fields from a HEADERS payload.
fn split_headers_payload(
    flags: u8,
    payload: &[u8],
) -> Result<(Option<[u8; PRIORITY_LEN]>, &[u8]), ProxyError> {
    let mut rest = payload;
    let mut padding = 0;
    if flags & FLAG_PADDED != 0 {
        let (&length, after) = rest
            .split_first()
            .ok_or(ProxyError::Protocol("PADDED HEADERS frame without pad length"))?;
        padding = usize::from(length);
        rest = after;
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        let (fields, after) = rest
            .split_first_chunk::<PRIORITY_LEN>()
            .ok_or(ProxyError::Protocol(
                "HEADERS frame too short for its priority fields",
            ))?;
        priority = Some(*fields);
        rest = after;
    }
    let fragment_len = rest
        .len()
        .checked_sub(padding)
        .ok_or(ProxyError::Protocol("HEADERS padding exceeds the payload"))?;
    Ok((priority, &rest[..fragment_len]))
}

fn push_frame_header(out: &mut Vec<u8>, length: usize, kind: u8, flags: u8, stream_id: u32) {
    let [.., l0, l1, l2] = length.to_be_bytes();
    out.extend_from_slice(&[l0, l1, l2, kind, flags]);
    out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
}

/// The per-connection HPACK state: a decoder following the client's encoder.
struct HeaderRewriter {
    decoder: Decoder<'static>,
}

impl HeaderRewriter {
    fn new() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(MAX_DECODER_TABLE);
        Self { decoder }
    }

    /// Decodes `block`, rewrites `:authority` and writes the frames carrying the re-encoded block
    /// into `out` (replacing its contents).
    fn rewrite(&mut self, block: &PendingBlock, out: &mut Vec<u8>) -> Result<(), ProxyError> {
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        let mut list_size = 0usize;
        self.decoder.decode_with_cb(&block.fragment, |name, value| {
            // Keep counting past the limit but stop encoding, so memory stays bounded while the
            // decoder still consumes the whole block.
            list_size = list_size.saturating_add(name.len() + value.len() + 32);
            if list_size > MAX_HEADER_LIST {
                return;
            }
            let value: &[u8] = if &name[..] == b":authority" {
                REWRITTEN_AUTHORITY
            } else {
                &value
            };
            encode_literal(&mut encoded, &name, value);
        })?;
        if list_size > MAX_HEADER_LIST {
            return Err(ProxyError::HeaderBlockTooLarge);
        }
        out.clear();
        encode_header_frames(block, &encoded, out);
        Ok(())
    }
}

/// HPACK "literal header field without indexing — new name" (RFC 7541 §6.2.2), no Huffman.
fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    encode_string(out, name);
    encode_string(out, value);
}

fn encode_string(out: &mut Vec<u8>, bytes: &[u8]) {
    encode_integer(out, 0x00, 7, bytes.len());
    out.extend_from_slice(bytes);
}

/// HPACK integer with an N-bit prefix (RFC 7541 §5.1); `flags` fills the bits above the prefix.
fn encode_integer(out: &mut Vec<u8>, flags: u8, prefix_bits: u32, value: usize) {
    let limit = (1usize << prefix_bits) - 1;
    if value < limit {
        out.push(flags | low_byte(value));
        return;
    }
    out.push(flags | low_byte(limit));
    let mut rest = value - limit;
    while rest >= 0x80 {
        out.push(0x80 | low_byte(rest & 0x7f));
        rest >>= 7;
    }
    out.push(low_byte(rest));
}

fn low_byte(value: usize) -> u8 {
    value.to_le_bytes()[0]
}

/// One HEADERS frame plus as many CONTINUATION frames as the block needs.
fn encode_header_frames(block: &PendingBlock, encoded: &[u8], out: &mut Vec<u8>) {
    let priority_len = if block.priority.is_some() { PRIORITY_LEN } else { 0 };
    let (first, mut rest) = encoded.split_at(encoded.len().min(MIN_MAX_FRAME_SIZE - priority_len));
    let flag = |set: bool, flag: u8| if set { flag } else { 0 };
    let flags = flag(block.end_stream, FLAG_END_STREAM)
        | flag(block.priority.is_some(), FLAG_PRIORITY)
        | flag(rest.is_empty(), FLAG_END_HEADERS);
    push_frame_header(
        out,
        priority_len + first.len(),
        TYPE_HEADERS,
        flags,
        block.stream_id,
    );
    out.extend(block.priority.iter().flatten());
    out.extend_from_slice(first);
    while !rest.is_empty() {
        let (chunk, after) = rest.split_at(rest.len().min(MIN_MAX_FRAME_SIZE));
        rest = after;
        let flags = flag(rest.is_empty(), FLAG_END_HEADERS);
        push_frame_header(out, chunk.len(), TYPE_CONTINUATION, flags, block.stream_id);
        out.extend_from_slice(chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(block: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        Decoder::new().decode(block).expect("valid block")
    }

    #[test]
    fn integers_match_rfc_examples() {
        // RFC 7541 C.1.1-C.1.3.
        let mut out = Vec::new();
        encode_integer(&mut out, 0, 5, 10);
        assert_eq!(out, [0x0a]);
        out.clear();
        encode_integer(&mut out, 0, 5, 1337);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
        out.clear();
        encode_integer(&mut out, 0, 8, 42);
        assert_eq!(out, [0x2a]);
    }

    #[test]
    fn rewrites_authority_and_keeps_everything_else() {
        let mut client = loona_hpack::Encoder::new();
        let fragment = client.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":authority", b"%2Ftmp%2Fx-reg.sock"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b"te", b"trailers"),
        ]);
        let block = PendingBlock {
            stream_id: 3,
            end_stream: false,
            priority: None,
            fragment,
        };
        let mut out = Vec::new();
        HeaderRewriter::new().rewrite(&block, &mut out).expect("rewrite");
        let header: [u8; FRAME_HEADER_LEN] = out[..FRAME_HEADER_LEN].try_into().expect("header");
        let frame = FrameHeader::parse(&header);
        assert_eq!(
            (frame.kind, frame.flags, frame.stream_id),
            (TYPE_HEADERS, FLAG_END_HEADERS, 3)
        );
        assert_eq!(frame.length, out.len() - FRAME_HEADER_LEN);
        let headers = decode(&out[FRAME_HEADER_LEN..]);
        assert_eq!(
            headers,
            vec![
                (b":method".to_vec(), b"POST".to_vec()),
                (b":authority".to_vec(), b"localhost".to_vec()),
                (
                    b":path".to_vec(),
                    b"/pluginregistration.Registration/GetInfo".to_vec()
                ),
                (b"te".to_vec(), b"trailers".to_vec()),
            ]
        );
    }

    #[test]
    fn large_blocks_are_split_into_continuations() {
        let big = vec![b'v'; 40_000];
        let fragment = {
            let mut out = Vec::new();
            encode_literal(&mut out, b"x-big", &big);
            out
        };
        let block = PendingBlock {
            stream_id: 1,
            end_stream: true,
            priority: Some([0, 0, 0, 0, 15]),
            fragment,
        };
        let mut out = Vec::new();
        HeaderRewriter::new().rewrite(&block, &mut out).expect("rewrite");
        let mut frames = Vec::new();
        let mut rest = &out[..];
        while !rest.is_empty() {
            let header: [u8; FRAME_HEADER_LEN] = rest[..FRAME_HEADER_LEN].try_into().expect("header");
            let frame = FrameHeader::parse(&header);
            assert!(frame.length <= MIN_MAX_FRAME_SIZE);
            frames.push((
                frame.kind,
                frame.flags,
                rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + frame.length].to_vec(),
            ));
            rest = &rest[FRAME_HEADER_LEN + frame.length..];
        }
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0].0, TYPE_HEADERS);
        assert_eq!(frames[0].1, FLAG_END_STREAM | FLAG_PRIORITY);
        assert_eq!(&frames[0].2[..PRIORITY_LEN], &[0, 0, 0, 0, 15]);
        assert_eq!((frames[1].0, frames[1].1), (TYPE_CONTINUATION, 0));
        assert_eq!((frames[2].0, frames[2].1), (TYPE_CONTINUATION, FLAG_END_HEADERS));
        let mut joined = frames[0].2[PRIORITY_LEN..].to_vec();
        joined.extend_from_slice(&frames[1].2);
        joined.extend_from_slice(&frames[2].2);
        assert_eq!(decode(&joined), vec![(b"x-big".to_vec(), big)]);
    }

    #[test]
    fn malformed_headers_payloads_are_errors() {
        assert!(split_headers_payload(FLAG_PADDED, &[]).is_err());
        assert!(split_headers_payload(FLAG_PADDED, &[5, 1, 2]).is_err());
        assert!(split_headers_payload(FLAG_PRIORITY, &[1, 2]).is_err());
        let (priority, fragment) =
            split_headers_payload(FLAG_PADDED | FLAG_PRIORITY, &[2, 0, 0, 0, 1, 16, 0x82, 0, 0])
                .expect("valid");
        assert_eq!(priority, Some([0, 0, 0, 1, 16]));
        assert_eq!(fragment, &[0x82]);
    }

    #[test]
    fn hpack_bombs_are_refused() {
        // One large entry in the dynamic table, then thousands of one-byte references to it.
        let mut fragment = vec![0x40];
        encode_string(&mut fragment, b"x-bomb");
        encode_string(&mut fragment, &[b'b'; 3000]);
        fragment.extend(std::iter::repeat_n(0xbe, 1000)); // indexed 62: the newest dynamic entry
        let block = PendingBlock {
            stream_id: 1,
            end_stream: false,
            priority: None,
            fragment,
        };
        let mut out = Vec::new();
        assert!(matches!(
            HeaderRewriter::new().rewrite(&block, &mut out),
            Err(ProxyError::HeaderBlockTooLarge)
        ));
    }
}
