//! Starting to serve the kernel: a fresh FUSE session at the mountpoint, or the live
//! connection a previous server of this mount left to the holder (`holder.rs`), with its
//! io_uring queues and what the holder must keep for the next server.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::holder;

/// Starts serving the kernel: a fresh mount at `mp` (its connection handed to the holder,
/// if there is one, with what INIT negotiated), or the live connection a previous server
/// of this mount left to the holder (`reattach`), whose lost requests are asked again.
/// Blocking (the mount's handshake).
pub(super) fn start_session(
    fs: locus_fuse::LocusFs,
    mp: &Path,
    config: fuser::Config,
    reattach: Option<holder::Reattach>,
    h: Option<Arc<holder::Channel>>,
    mounted_version: u64,
) -> std::io::Result<(fuser::BackgroundSession, Ours)> {
    use std::os::fd::AsFd;
    let (pt, ko) = (fs.passthrough_state(), fs.kernel_opens_state());
    let Some(r) = reattach else {
        let mut s = fuser::Session::new(fs, mp, &config)?;
        // Read now, while nothing else can have mounted over it.
        let device = locus_fuse::mount_device(mp);
        let io_uring_payload = s.io_uring_payload();
        let ring = start_rings(&mut s);
        let ours = Ours {
            fuse: s.as_fd().try_clone_to_owned()?,
            device: device.clone(),
            ring,
            control: s.ring_control(),
        };
        if let Some(h) = &h {
            let v = s.proto_version().unwrap_or(fuser::Version(7, 0));
            let state = holder::SessionState {
                version: mounted_version,
                proto_major: v.0,
                proto_minor: v.1,
                negotiated: locus_fuse::fs::Negotiated {
                    // Set by init, during the handshake `Session::new` ran.
                    passthrough: pt.load(Ordering::Relaxed),
                    kernel_opens: ko.load(Ordering::Relaxed),
                },
                backing: Default::default(),
                device,
                io_uring_payload: io_uring_payload.filter(|_| ring),
                ring_memory: None,
            };
            h.session(s.as_fd(), &state)?;
            hand_over_rings(&s, h);
        }
        return Ok((s.spawn()?, ours));
    };
    fs.restore(r.state.negotiated, r.state.backing.clone().into_iter().collect());
    let acl = config.acl;
    let v = fuser::Version(r.state.proto_major, r.state.proto_minor);
    let mut s = fuser::Session::from_initialized_fd(fs, r.fuse, acl, config, v);
    if let Some(p) = r.state.io_uring_payload {
        s = s.with_io_uring(p);
        if let (Some(fd), Some(layout)) = (r.ring, r.state.ring_memory) {
            s = s.adopt_ring_memory(fd, layout.into());
        }
    }
    let ring = start_rings(&mut s);
    if let Some(h) = &h {
        hand_over_rings(&s, h);
    }
    let control = s.ring_control();
    let fd = s.as_fd().try_clone_to_owned()?;
    let bg = s.spawn()?;
    if let Err(e) = holder::resend_lost_requests(fd.as_fd()) {
        tracing::warn!(
            "this kernel cannot resend requests the previous server read ({e}; Linux 6.9+): their readers wait until unmount"
        );
    }
    if ring {
        holder::wake_ring_queues(mp);
    }
    let ours = Ours {
        fuse: fd,
        device: r.state.device.clone(),
        ring,
        control,
    };
    Ok((bg, ours))
}

/// Tells the holder where the ring queues' entries are, for the next server (a taken-over
/// server whose memory is the holder's already sends it again: harmless).
fn hand_over_rings(s: &fuser::Session<locus_fuse::LocusFs>, h: &holder::Channel) {
    if let Some((fd, layout)) = s.ring_memory() {
        if let Err(e) = h.rings(fd, layout.into()) {
            tracing::warn!("cannot hand the holder the ring entries' memory: {e}");
        }
    }
}

/// Registers the connection's FUSE-over-io_uring queues when INIT negotiated them:
/// whether requests come through them (else /dev/fuse serves, the kernel having been
/// told so by the refused registration).
fn start_rings(s: &mut fuser::Session<locus_fuse::LocusFs>) -> bool {
    match s.start_io_uring() {
        Ok(on) => on,
        Err(e) => {
            tracing::warn!("the kernel refused FUSE over io_uring queues ({e}); serving through /dev/fuse");
            false
        }
    }
}

/// What tells this mount from a later one at the same path: its connection and device.
pub(super) struct Ours {
    pub(super) fuse: std::os::fd::OwnedFd,
    pub(super) device: Option<String>,
    /// Requests come through FUSE-over-io_uring queues.
    pub(super) ring: bool,
    /// Freezes those queues before a planned restart (SIGUSR2 from the holder).
    pub(super) control: Option<Arc<fuser::RingControl>>,
}
