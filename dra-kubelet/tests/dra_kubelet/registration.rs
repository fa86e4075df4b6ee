//! Plugin registration over the real registration socket, through the `:authority` proxy: with a
//! tonic client, and with the exact bytes the kubelet's grpc-go client sends.

use std::time::Duration;

use dra_kubelet::RegistrationState;
use migdra_proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_client::RegistrationClient,
    registration_server::{Registration, RegistrationServer},
};
use migdra_testkit::dra_kubelet::{
    CONTINUATION, DRIVER, END_HEADERS, GUARD, HEADERS, Harness, PADDED, PRIORITY, PROTOCOL_ERROR, RawClient,
    SETTINGS, channel, frame, get_info_block, huffman, percent_encoded, repeated_get_info_block,
    short_tempdir,
};
use prost::Message;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

fn expected_info(h: &Harness) -> PluginInfo {
    PluginInfo {
        r#type: "DRAPlugin".to_string(),
        name: DRIVER.to_string(),
        endpoint: h.dra_socket.display().to_string(),
        supported_versions: [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ]
        .map(String::from)
        .to_vec(),
    }
}

/// Asserts a successful unary gRPC answer carrying `info`.
fn assert_plugin_info(response: &migdra_testkit::dra_kubelet::RawResponse, info: &PluginInfo) {
    assert_eq!(response.header(":status"), Some("200"), "{response:?}");
    assert_eq!(response.header("grpc-status"), Some("0"), "{response:?}");
    assert_eq!(&PluginInfo::decode(response.message()).expect("PluginInfo"), info);
}

#[tokio::test]
async fn get_info_and_notify_through_the_proxy() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    assert!(h.dra_socket.is_absolute());
    assert_eq!(
        h.dra_socket,
        h.dir.path().join(format!("plugins/{DRIVER}/dra.sock"))
    );
    assert_eq!(
        h.registration_socket,
        h.dir.path().join(format!("plugins_registry/{DRIVER}-reg.sock"))
    );

    let mut client = RegistrationClient::new(channel(&h.registration_socket).await);
    let info = client
        .get_info(InfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner();
    assert_eq!(info, expected_info(&h));

    client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .expect("accepted");
    assert_eq!(
        *h.registration.borrow_and_update(),
        RegistrationState {
            registered: true,
            error: None
        }
    );

    let rejected = client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "duplicate endpoint".to_string(),
        })
        .await
        .expect_err("a failed registration is answered with an error");
    assert!(rejected.message().contains("duplicate endpoint"), "{rejected:?}");
    assert_eq!(
        *h.registration.borrow_and_update(),
        RegistrationState {
            registered: false,
            error: Some("duplicate endpoint".to_string())
        }
    );
    h.stop().await;
}

#[tokio::test]
async fn kubelet_request_with_percent_encoded_authority_succeeds() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    let authority = percent_encoded(&h.registration_socket);
    assert!(authority.starts_with("%2Ftmp%2Fmd") && authority.ends_with(&format!("%2F{DRIVER}-reg.sock")));

    let mut kubelet = RawClient::connect(&h.registration_socket).await;
    let headers = frame(HEADERS, END_HEADERS, 1, &get_info_block(&authority, false));
    let response = kubelet.unary(1, &headers, &[]).await;
    assert_plugin_info(&response, &expected_info(&h));
    assert_eq!(response.header("content-type"), Some("application/grpc"));
    // A raw client answers no PING while idle, which would hold up h2's graceful shutdown.
    drop(kubelet);
    h.stop().await;
}

#[tokio::test]
async fn huffman_and_dynamic_table_references_are_followed() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    let authority = percent_encoded(&h.registration_socket);
    let block = get_info_block(&authority, true);
    assert!(
        block.len() < get_info_block(&authority, false).len(),
        "Huffman is in use"
    );

    let mut kubelet = RawClient::connect(&h.registration_socket).await;
    let first = kubelet
        .unary(1, &frame(HEADERS, END_HEADERS, 1, &block), &[])
        .await;
    assert_plugin_info(&first, &expected_info(&h));
    // The second call on the connection refers only to the dynamic table the first one filled,
    // as grpc-go does: the proxy's decoder must have followed the client's encoder.
    let second = kubelet
        .unary(
            3,
            &frame(HEADERS, END_HEADERS, 3, &repeated_get_info_block()),
            &[],
        )
        .await;
    assert_plugin_info(&second, &expected_info(&h));
    drop(kubelet);
    h.stop().await;
}

#[tokio::test]
async fn header_block_split_across_continuation_with_padding_and_priority() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    let block = get_info_block(&percent_encoded(&h.registration_socket), true);
    let (a, rest) = block.split_at(7);
    let (b, c) = rest.split_at(rest.len() / 2);

    // HEADERS with PADDED + PRIORITY: pad length, 5 priority bytes, fragment, padding.
    let mut payload = vec![4u8, 0, 0, 0, 0, 15];
    payload.extend_from_slice(a);
    payload.extend_from_slice(&[0; 4]);
    let mut frames = frame(HEADERS, PADDED | PRIORITY, 1, &payload);
    frames.extend(frame(CONTINUATION, 0, 1, b));
    frames.extend(frame(CONTINUATION, END_HEADERS, 1, c));

    let mut kubelet = RawClient::connect(&h.registration_socket).await;
    let response = kubelet.unary(1, &frames, &[]).await;
    assert_plugin_info(&response, &expected_info(&h));
    drop(kubelet);
    h.stop().await;
}

/// A registration service answering GetInfo with a fixed name, to be served by plain tonic.
struct FixedInfo;

#[tonic::async_trait]
impl Registration for FixedInfo {
    async fn get_info(
        &self,
        _request: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(PluginInfo {
            name: DRIVER.to_string(),
            ..PluginInfo::default()
        }))
    }

    async fn notify_registration_status(
        &self,
        _request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}

#[tokio::test]
async fn plain_tonic_rejects_the_kubelet_request() {
    // Without the proxy: a registration service, the same bytes, straight into tonic.
    let dir = short_tempdir();
    let path = dir.path().join("plain-reg.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let stop = CancellationToken::new();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(FixedInfo))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop.clone().cancelled_owned()),
    );

    let mut kubelet = RawClient::connect(&path).await;
    let block = get_info_block(&percent_encoded(&path), false);
    let response = kubelet
        .unary(1, &frame(HEADERS, END_HEADERS, 1, &block), &[])
        .await;
    assert_eq!(
        response.header("grpc-status"),
        None,
        "no gRPC answer: {response:?}"
    );
    assert!(response.data.is_empty());
    assert!(
        response.reset == Some(PROTOCOL_ERROR) || response.goaway == Some(PROTOCOL_ERROR),
        "h2 refuses the authority with PROTOCOL_ERROR: {response:?}"
    );

    // The control: a valid authority on the same server works, so the authority is the cause.
    let mut control = RawClient::connect(&path).await;
    let block = get_info_block("localhost", false);
    let response = control
        .unary(1, &frame(HEADERS, END_HEADERS, 1, &block), &[])
        .await;
    assert_eq!(response.header("grpc-status"), Some("0"), "{response:?}");

    stop.cancel();
    drop((kubelet, control));
    tokio::time::timeout(GUARD, server)
        .await
        .expect("stopped")
        .expect("joined")
        .expect("served");
}

#[tokio::test]
async fn malformed_input_closes_only_that_connection() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;

    // Not HTTP/2 at all.
    let mut http1 = tokio::net::UnixStream::connect(&h.registration_socket)
        .await
        .expect("connect");
    tokio::io::AsyncWriteExt::write_all(&mut http1, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(GUARD, tokio::io::AsyncReadExt::read_to_end(&mut http1, &mut buf))
        .await
        .expect("closed in time");
    assert!(
        read.is_err() || buf.is_empty(),
        "closed without an answer: {buf:?}"
    );

    // CONTINUATION without a header block.
    let mut stray = RawClient::connect(&h.registration_socket).await;
    stray.send(&frame(CONTINUATION, END_HEADERS, 1, &[0x82])).await;
    assert!(
        tokio::time::timeout(GUARD, stray.closed_by_peer())
            .await
            .expect("closed in time")
    );

    // A header block interrupted by another frame.
    let mut interrupted = RawClient::connect(&h.registration_socket).await;
    interrupted.send(&frame(HEADERS, 0, 1, &[0x83])).await;
    interrupted.send(&frame(SETTINGS, 0, 0, &[])).await;
    assert!(
        tokio::time::timeout(GUARD, interrupted.closed_by_peer())
            .await
            .expect("closed in time")
    );

    // An undecodable HPACK block (index 0 is invalid) and a truncated Huffman string.
    for block in [vec![0x80], vec![0x41, 0x85, huffman("ab")[0]]] {
        let mut broken = RawClient::connect(&h.registration_socket).await;
        broken.send(&frame(HEADERS, END_HEADERS, 1, &block)).await;
        assert!(
            tokio::time::timeout(GUARD, broken.closed_by_peer())
                .await
                .expect("closed in time")
        );
    }

    // Padding longer than the frame.
    let mut padded = RawClient::connect(&h.registration_socket).await;
    padded
        .send(&frame(HEADERS, END_HEADERS | PADDED, 1, &[200, 0x82]))
        .await;
    assert!(
        tokio::time::timeout(GUARD, padded.closed_by_peer())
            .await
            .expect("closed in time")
    );

    // A header block larger than the proxy accepts.
    let mut huge = RawClient::connect(&h.registration_socket).await;
    let chunk = vec![0u8; 16_384];
    huge.send(&frame(HEADERS, 0, 1, &chunk)).await;
    let mut closed = false;
    for _ in 0..8 {
        // The proxy may close mid-way; a failed write is as good as a close.
        if tokio::io::AsyncWriteExt::write_all(huge.stream_mut(), &frame(CONTINUATION, 0, 1, &chunk))
            .await
            .is_err()
        {
            closed = true;
            break;
        }
    }
    if !closed {
        assert!(
            tokio::time::timeout(GUARD, huge.closed_by_peer())
                .await
                .expect("closed in time")
        );
    }

    // The server is unaffected.
    let mut client = RegistrationClient::new(channel(&h.registration_socket).await);
    assert_eq!(
        client
            .get_info(InfoRequest {})
            .await
            .expect("GetInfo")
            .into_inner(),
        expected_info(&h)
    );
    h.stop().await;
}
