//! The gRPC server every node runs: mutual TLS under the cluster CA when
//! configured, TCP keepalive, and connections closed once idle, so that
//! callers that open connections and go quiet cannot pile them up.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tonic::transport::Server;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::NodeOptions;
use crate::error::WorkerError;

/// TCP keepalive on accepted connections: finds peers that vanished
/// without a reset (a partition, a powered-off host).
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// A server builder with the node's transport settings; the role adds its
/// services and hands it to [`crate::node::serve`].
pub fn server(opts: &NodeOptions) -> Result<Server, WorkerError> {
    let builder = Server::builder().tcp_keepalive(Some(TCP_KEEPALIVE));
    match &opts.tls {
        None => Ok(builder),
        Some(tls) => builder
            .tls_config(tls.server_config())
            .map_err(|e| WorkerError::Internal(format!("gRPC TLS: {e}"))),
    }
}

/// A TCP connection that fails its next read once no byte has moved either
/// way for `idle`: the HTTP/2 server then closes it. Streams that are alive
/// move bytes (tokens, or our clients' keepalive pings while a call is
/// open), so only connections with nothing going on are closed.
#[derive(Debug)]
pub struct IdleTimeoutIo {
    inner: TcpStream,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
}

impl IdleTimeoutIo {
    pub fn new(inner: TcpStream, idle: Duration) -> IdleTimeoutIo {
        IdleTimeoutIo {
            inner,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
        }
    }

    fn touch(&mut self) {
        let at = Instant::now() + self.idle;
        self.timer.as_mut().reset(at);
    }
}

impl AsyncRead for IdleTimeoutIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.touch();
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                ready!(self.timer.as_mut().poll(cx));
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection idle",
                )))
            }
        }
    }
}

impl AsyncWrite for IdleTimeoutIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = ready!(Pin::new(&mut self.inner).poll_write(cx, buf));
        if matches!(r, Ok(n) if n > 0) {
            self.touch();
        }
        Poll::Ready(r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Connected for IdleTimeoutIo {
    // The TCP stream's own, so handlers (and TLS peer-certificate lookups)
    // see the connection as tonic would without the wrapper.
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair(idle: Duration) -> (IdleTimeoutIo, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        (IdleTimeoutIo::new(server, idle), client)
    }

    #[tokio::test]
    async fn a_quiet_connection_fails_its_read_after_the_idle_time() {
        let (mut server, _client) = pair(Duration::from_millis(200)).await;
        let t0 = Instant::now();
        let mut buf = [0u8; 8];
        let err = server.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn traffic_either_way_keeps_it_open() {
        let (mut server, mut client) = pair(Duration::from_secs(1)).await;
        let mut buf = [0u8; 8];
        let t0 = Instant::now();
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            client.write_all(b"ping").await.unwrap();
            assert_eq!(server.read(&mut buf).await.unwrap(), 4);
            tokio::time::sleep(Duration::from_millis(150)).await;
            server.write_all(b"pong").await.unwrap();
            assert_eq!(client.read(&mut buf).await.unwrap(), 4);
        }
        // Open for more than twice the idle time, never idle for it.
        assert!(t0.elapsed() > Duration::from_secs(2));
        drop(client);
        assert_eq!(server.read(&mut buf).await.unwrap(), 0, "clean EOF");
    }
}
