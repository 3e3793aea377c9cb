package position

// WALLayout is a server's WAL geometry, from pg_control_init():
// max_data_alignment, wal_block_size and bytes_per_wal_segment.
type WALLayout struct {
	MaxAlign    uint64
	BlockSize   uint64
	SegmentSize uint64
}

// Page header sizes with 8-byte MAXALIGN: SizeOfXLogShortPHD on every WAL
// page but a segment's first, SizeOfXLogLongPHD on that one.
const (
	shortPageHeader = 24
	longPageHeader  = 40
)

// InsertEnd turns pg_current_wal_insert_lsn() into the end of the WAL
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
func (l WALLayout) InsertEnd(lsn LSN) LSN {
	if l.MaxAlign != 8 || l.BlockSize == 0 || l.SegmentSize == 0 ||
		l.SegmentSize%l.BlockSize != 0 || l.BlockSize <= longPageHeader {
		return lsn
	}
	off := uint64(lsn) % l.SegmentSize
	switch {
	case off == longPageHeader:
		return lsn - longPageHeader
	case off >= l.BlockSize && off%l.BlockSize == shortPageHeader:
		return lsn - shortPageHeader
	}
	return lsn
}
