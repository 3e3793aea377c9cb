package enqueue

import "github.com/caughtup/caughtup/position"

// walLayout is the server's WAL geometry from pg_control_init().
type walLayout struct {
	maxAlign    uint64 // max_data_alignment
	blockSize   uint64 // wal_block_size
	segmentSize uint64 // bytes_per_wal_segment
}

// Page header sizes with 8-byte MAXALIGN: SizeOfXLogShortPHD on every WAL
// page but a segment's first, SizeOfXLogLongPHD on that one.
const (
	shortPageHeader = 24
	longPageHeader  = 40
)

// endPosition turns pg_current_wal_insert_lsn() into the end of the WAL
// inserted so far, the form pg_last_wal_replay_lsn() has.
//
// The insert position is where the next record will start. When the last
// record ended exactly at a page boundary, or a WAL switch ended the
// segment, the next record starts after the new page's header, so the
// insert position is 24 (40 at a segment start) bytes past the page
// boundary; but a replica that has replayed everything reports the
// boundary itself, the end of that last record. Stamped as is, such a
// token would not be satisfied until some later record is written,
// flushed and replayed: on a quiet primary that is the background writer's
// next standby snapshot, up to ~15 s away. No WAL byte lies between the
// boundary and the insert position, so the boundary is exact, never early.
//
// Only servers with 8-byte alignment (every 64-bit platform) are handled;
// for others the position is returned unchanged, which is at worst late.
func endPosition(lsn position.LSN, l walLayout) position.LSN {
	if l.maxAlign != 8 || l.blockSize == 0 || l.segmentSize == 0 ||
		l.segmentSize%l.blockSize != 0 || l.blockSize <= longPageHeader {
		return lsn
	}
	off := uint64(lsn) % l.segmentSize
	switch {
	case off == longPageHeader:
		return lsn - longPageHeader
	case off >= l.blockSize && off%l.blockSize == shortPageHeader:
		return lsn - shortPageHeader
	}
	return lsn
}
