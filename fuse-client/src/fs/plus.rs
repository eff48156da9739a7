//! Directory listings handed to the kernel: what the core lists (`Core::list`, which
//! holds the listing policy, `core::listing`), added to fuser's reply until it is full.

use fuser::{Generation, INodeNo, ReplyDirectory, ReplyDirectoryPlus};

use super::{errno, file_type, TTL};

impl super::Mount {
    /// READDIR: names and types.
    pub(super) fn list(&self, ino: u64, offset: u64, mut reply: ReplyDirectory) {
        let listing = match self.core.list(ino, offset, false) {
            Ok(l) => l,
            Err(e) => return reply.error(errno("readdir", &e)),
        };
        for e in listing.entries {
            if reply.add(INodeNo(e.ino), e.offset, file_type(e.kind), e.name) {
                break;
            }
        }
        reply.ok();
    }

    /// READDIRPLUS: names with attributes or without, as the policy decides.
    pub(super) fn list_plus(&self, ino: u64, offset: u64, mut reply: ReplyDirectoryPlus) {
        let gen = Generation(self.core.settings.generation);
        let listing = match self.core.list(ino, offset, true) {
            Ok(l) => l,
            Err(e) => return reply.error(errno("readdirplus", &e)),
        };
        let mut children = 0;
        for e in listing.entries {
            let Some(a) = &e.attr else { continue };
            let attr = self.file_attr(a);
            let dot = e.offset <= 2;
            let full = match dot || listing.attributes {
                true => reply.add(INodeNo(e.ino), e.offset, e.name, &TTL, &attr, gen),
                false => reply.add_name_only(INodeNo(e.ino), e.offset, e.name, &attr),
            };
            if full {
                break;
            }
            children += u64::from(!dot);
        }
        self.core.metrics.listed(listing.attributes, children);
        reply.ok();
    }
}
