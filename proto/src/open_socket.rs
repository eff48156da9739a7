//! The open socket's wire: where a same-host caller who is not trusted with a node's data
//! dir (a team's job on a shared host) presents a read grant and gets a blob as an open
//! file descriptor instead of a path (`OpenBlobRequest`/`OpenBlobResponse` in node.proto).
//!
//! A descriptor is as good as a path for reading (and for the kernel's FUSE passthrough),
//! but it opens that one blob only: the data dir itself stays the node's (0700), so the
//! node can check each blob against the caller's grant before handing it out, as it does
//! for remote callers. The socket is the node's local socket path with `.open` appended.
//!
//! Frames are a u32 little-endian length and the message; a response's descriptor rides
//! (SCM_RIGHTS) on the sendmsg that carries its frame. A connection carries any number of
//! requests, one at a time.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prost::Message;

use crate::nodepb::{OpenBlobRequest, OpenBlobResponse};

/// Appended to the local socket's path.
pub const SUFFIX: &str = ".open";
/// Frames are small (a hash, a grant of ~300 bytes); anything longer is refused unread.
const MAX_FRAME: usize = 16 << 10;

/// The open socket beside the local socket `local`.
pub fn path_of(local: &Path) -> PathBuf {
    let mut s = local.as_os_str().to_owned();
    s.push(SUFFIX);
    s.into()
}

/// Reads one frame; None at a clean end of the connection.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {n} bytes; at most {MAX_FRAME}"),
        ));
    }
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf)?;
    Ok(Some(buf))
}

fn frame(msg: &impl Message) -> Vec<u8> {
    let body = msg.encode_to_vec();
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Most descriptors one answer carries: the asked blob and 64 more.
pub const MAX_FDS: usize = 65;

/// Sends a response frame on `sock`, with `fds` attached (at most MAX_FDS).
pub fn send_response(sock: &UnixStream, resp: &OpenBlobResponse, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let bytes = frame(resp);
    if fds.is_empty() {
        return (&*sock).write_all(&bytes);
    }
    if fds.len() > MAX_FDS {
        return Err(io::Error::other(format!(
            "{} descriptors; at most {MAX_FDS}",
            fds.len()
        )));
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let sent = sendmsg::<()>(
        sock.as_raw_fd(),
        &[io::IoSlice::new(&bytes)],
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io::Error::from)?;
    // The descriptors went with the first byte; the rest of a short send follows plainly.
    (&*sock).write_all(&bytes[sent..])
}

/// Receives the start of a response and the descriptors sent with it.
fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut control = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut control),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(got) = c {
            // SAFETY: descriptors the kernel passed are this process's from now on;
            // each is wrapped once, so it is closed when unused.
            #[allow(unsafe_code)]
            fds.extend(got.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(io::Error::other(
            "the node sent more descriptors than an answer holds",
        ));
    }
    Ok((msg.bytes, fds))
}

/// Sends one request on a connection and reads its answer: the response, and the files
/// the node handed out, in the response's order (the asked blob's when it answered OK,
/// then each present one of `more`).
pub fn ask(sock: &UnixStream, req: &OpenBlobRequest) -> io::Result<(OpenBlobResponse, Vec<std::fs::File>)> {
    (&*sock).write_all(&frame(req))?;
    let mut head = [0u8; 4096];
    let (n, fds) = recv_with_fds(sock, &mut head)?;
    if n < 4 {
        // A frame's length is 4 bytes, sent in one go: fewer is the node going away.
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the node closed the open socket's connection",
        ));
    }
    let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "an oversized answer"));
    }
    if n > 4 + len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more bytes than the answer's frame",
        ));
    }
    let mut body = head[4..n].to_vec();
    if body.len() < len {
        let mut rest = vec![0u8; len - body.len()];
        (&*sock).read_exact(&mut rest)?;
        body.extend_from_slice(&rest);
    }
    let resp =
        OpenBlobResponse::decode(&body[..]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((resp, fds.into_iter().map(std::fs::File::from).collect()))
}

/// Connects to the open socket at `path`, every read and write bounded by `timeout`.
pub fn connect(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_crosses_with_its_answer_and_an_error_comes_without_one() {
        let (a, b) = UnixStream::pair().unwrap();
        let dir = std::env::temp_dir().join(format!("locus-open-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("blob");
        std::fs::write(&p, b"the blob's bytes").unwrap();
        let server = std::thread::spawn(move || {
            let mut s = &b;
            for i in 0..3 {
                let f = read_frame(&mut s).unwrap().unwrap();
                let q = OpenBlobRequest::decode(&f[..]).unwrap();
                assert_eq!(q.grant, format!("g{i}"));
                if i == 0 {
                    let file = std::fs::File::open(&p).unwrap();
                    let ok = OpenBlobResponse {
                        offset: 7,
                        ..Default::default()
                    };
                    send_response(&b, &ok, &[std::os::fd::AsFd::as_fd(&file)]).unwrap();
                } else if i == 2 {
                    // Many at once, in order.
                    let files: Vec<_> = (0..MAX_FDS).map(|_| std::fs::File::open(&p).unwrap()).collect();
                    let fds: Vec<_> = files.iter().map(std::os::fd::AsFd::as_fd).collect();
                    send_response(&b, &OpenBlobResponse::default(), &fds).unwrap();
                } else {
                    let no = OpenBlobResponse {
                        code: 5,
                        message: "blob x is not on this node".into(),
                        ..Default::default()
                    };
                    send_response(&b, &no, &[]).unwrap();
                }
            }
            assert!(read_frame(&mut s).unwrap().is_none(), "a clean end");
        });
        let q = |g: &str| OpenBlobRequest {
            grant: g.into(),
            ..Default::default()
        };
        let (r, f) = ask(&a, &q("g0")).unwrap();
        assert_eq!((r.code, r.offset), (0, 7));
        let mut got = String::new();
        let mut f = f.into_iter();
        f.next().expect("a descriptor").read_to_string(&mut got).unwrap();
        assert_eq!(got, "the blob's bytes");
        let (r, f) = ask(&a, &q("g1")).unwrap();
        assert_eq!(r.code, 5);
        assert!(f.is_empty());
        let (r, f) = ask(&a, &q("g2")).unwrap();
        assert_eq!(r.code, 0);
        assert_eq!(f.len(), MAX_FDS);
        let mut head = [0u8; 3];
        std::os::unix::fs::FileExt::read_exact_at(&f[MAX_FDS - 1], &mut head, 0).unwrap();
        assert_eq!(&head, b"the");
        drop(a);
        server.join().unwrap();
        // A frame over the limit is refused unread.
        let (c, d) = UnixStream::pair().unwrap();
        (&c).write_all(&((MAX_FRAME as u32) + 1).to_le_bytes()).unwrap();
        let e = read_frame(&mut &d).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
