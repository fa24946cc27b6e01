//! Mutual TLS between two nodes on real loopback sockets: members of one cluster CA talk;
//! a node of another cluster, or one that lies about its name, is refused.

use ferry_transport::{tls, ClusterCa, Credentials, Msg};
use std::path::Path;
use std::time::Duration;
use tokio::net::TcpListener;

fn creds(ca: &ClusterCa, dir: &Path, name: &str) -> Credentials {
    let paths = ca.issue_node_files(name, dir).unwrap();
    Credentials::load(&paths).unwrap()
}

fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-tls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test]
async fn members_talk_strangers_are_refused() {
    let dir = scratch("ca");
    let ca = ClusterCa::generate("test").unwrap();
    ca.save(&dir).unwrap();
    // A CA saved and loaded again issues certificates the cluster accepts.
    let ca = ClusterCa::load(&dir).unwrap();
    let a = creds(&ca, &dir, "a");
    let b = creds(&ca, &dir, "b");
    assert_eq!(a.node, "a");

    let other_dir = scratch("other");
    let other_ca = ClusterCa::generate("other").unwrap();
    let stranger = creds(&other_ca, &other_dir, "a");

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut results = Vec::new();
        for _ in 0..2 {
            let (tcp, _) = listener.accept().await.unwrap();
            results.push(tls::accept(&b, tcp).await.map(|c| c.peer));
        }
        results
    });

    let mut conn = tls::connect(&a, Some("b"), addr, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(conn.peer, "b");
    ferry_transport::write_msg(&mut conn.stream, &Msg::Commit)
        .await
        .unwrap();
    let refused = tls::connect(&stranger, None, addr, Duration::from_secs(5)).await;
    assert!(refused.is_err(), "a foreign certificate was accepted");

    let results = server.await.unwrap();
    assert_eq!(results[0].as_ref().unwrap(), "a");
    let err = format!("{:#}", results[1].as_ref().unwrap_err());
    assert!(err.contains("TLS handshake"), "{err}");
}
