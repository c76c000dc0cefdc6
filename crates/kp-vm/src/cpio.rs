//! The initramfs archive: cpio in the "new ASCII" format (`newc`, magic `070701`), the one the
//! kernel unpacks. Directories and regular files are all this initramfs needs.

/// An archive being written.
#[derive(Debug, Default)]
pub(crate) struct Archive {
    bytes: Vec<u8>,
    next_ino: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;

impl Archive {
    /// A directory (its parents must come first).
    pub(crate) fn dir(&mut self, path: &str) {
        self.entry(path, S_IFDIR | 0o755, 2, &[]);
    }

    /// A regular file with permission bits `mode`.
    pub(crate) fn file(&mut self, path: &str, mode: u32, content: &[u8]) {
        self.entry(path, S_IFREG | mode, 1, content);
    }

    /// Ends the archive (the `TRAILER!!!` entry) and returns its bytes.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 1, &[]);
        self.bytes
    }

    fn entry(&mut self, path: &str, mode: u32, nlink: u32, data: &[u8]) {
        self.next_ino += 1;
        let name_len = path.len() + 1;
        let fields = [
            self.next_ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // devmajor
            0, // devminor
            0, // rdevmajor
            0, // rdevminor
            name_len as u32,
            0, // check
        ];
        self.bytes.extend_from_slice(b"070701");
        for f in fields {
            self.bytes.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(path.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    /// Header plus name, and data, are each padded to 4 bytes.
    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }
}
