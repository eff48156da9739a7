//! An in-memory `KvStore` for unit tests of the catalogue. Never used by the service.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Mutex;

use super::{Batch, Derived, KvStore, Op, ScanIter, StoreError, Table};

type Tables = BTreeMap<(Table, Vec<u8>), Vec<u8>>;

#[derive(Default)]
pub struct MemStore {
    tables: Mutex<Tables>,
}

impl KvStore for MemStore {
    fn get(&self, t: Table, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let m = self.tables.lock().expect("mem store lock poisoned");
        Ok(m.get(&(t, key.to_vec())).cloned())
    }

    fn scan<'a>(&'a self, t: Table, from: &[u8], to: Option<&[u8]>) -> ScanIter<'a> {
        let m = self.tables.lock().expect("mem store lock poisoned");
        let end = match to {
            Some(to) => Bound::Excluded((t, to.to_vec())),
            None => match Table::ALL.iter().find(|x| **x > t) {
                Some(next) => Bound::Excluded((*next, Vec::new())),
                None => Bound::Unbounded,
            },
        };
        let items: Vec<_> = m
            .range((Bound::Included((t, from.to_vec())), end))
            .map(|((_, k), v)| Ok((k.clone().into_boxed_slice(), v.clone().into_boxed_slice())))
            .collect();
        Box::new(items.into_iter())
    }

    fn write(&self, batch: Batch, _sync: bool) -> Result<(), StoreError> {
        let mut derived = Vec::new();
        for op in batch.ops() {
            if let Op::Derive(t, what) = op {
                derived.push((t, super::derived(self, t, what)?));
            }
        }
        let mut m = self.tables.lock().expect("mem store lock poisoned");
        for (t, d) in derived {
            match d {
                Derived::Put(rows) => {
                    for (k, v) in rows {
                        m.insert((t, k.to_vec()), v.to_vec());
                    }
                }
                Derived::Delete(keys) => {
                    for k in keys {
                        m.remove(&(t, k.to_vec()));
                    }
                }
            }
        }
        for op in batch.ops() {
            match op {
                Op::Derive(..) => {}
                Op::Put(t, k, v) => {
                    m.insert((t, k.to_vec()), v.to_vec());
                }
                Op::Delete(t, k) => {
                    m.remove(&(t, k.to_vec()));
                }
                Op::DeleteRange(t, from, to) => {
                    let keys: Vec<_> = m
                        .range((t, from.to_vec())..(t, to.to_vec()))
                        .map(|(k, _)| k.clone())
                        .collect();
                    for k in keys {
                        m.remove(&k);
                    }
                }
            }
        }
        Ok(())
    }

    fn export(&self, tables: &[Table], visit: &mut super::ExportVisitor<'_>) -> Result<(), StoreError> {
        // Holding the lock for the whole visit makes it one instant.
        let m = self.tables.lock().expect("mem store lock poisoned");
        for t in tables {
            for ((_, k), v) in m.range((*t, Vec::new())..).take_while(|((x, _), _)| x == t) {
                visit(*t, k, v)?;
            }
        }
        Ok(())
    }

    fn size_on_disk(&self) -> u64 {
        0
    }
}
