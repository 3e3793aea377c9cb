package feed

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/sign"
)

// formatVersion is the first byte of every message. A subscriber rejects
// any other value (rejectUnsupportedVersion) rather than guessing, so a
// new format needs subscribers that read it before publishers send it.
const formatVersion = 1

// macSize is the length of the HMAC-SHA256 that ends a signed message.
const macSize = sign.Size

// Flag bits. Unknown bits are malformed: every accepted message has one
// meaning and one encoding.
const (
	flagHistoryKnown = 1 << 0 // primary

	flagInRecovery     = 1 << 0 // replica
	flagReplayTS       = 1 << 1
	flagIncarnation    = 1 << 2
	flagRecoveryStart  = 1 << 3 // only with flagIncarnation
	replicaFlagsDefine = flagInRecovery | flagReplayTS | flagIncarnation | flagRecoveryStart
)

// message is one observation in its envelope, as on the wire (see the
// package documentation for the layout).
type message struct {
	keyID     string // empty: unsigned
	publisher string
	instance  uint64
	seq       uint64
	sentAt    time.Time     // publisher's clock, µs; informational only
	ttl       time.Duration // the PX the value was stored with, ms; 0: not stored
	held      time.Duration // poll start → encoding, publisher's monotonic clock, µs
	obs       Observation

	signed []byte // the bytes the MAC covers (parse only)
	mac    []byte // parse only
}

// ErrMalformed is wrapped by every error about a message that does not
// parse: wrong length, a field out of range, trailing bytes.
var ErrMalformed = errors.New("caughtup/feed: malformed message")

// ErrUnsupportedVersion: the message's format version is not one this
// subscriber reads. Upgrade subscribers before publishers.
var ErrUnsupportedVersion = errors.New("caughtup/feed: unsupported message format version; upgrade the subscribers before the publishers")

// FormatError says what in a message did not parse, and where.
type FormatError struct {
	// Offset is the byte offset of the field that failed.
	Offset int
	// What names the field and the fault.
	What string
	err  error
}

func (e *FormatError) Error() string {
	return e.err.Error() + ": " + e.What + " at byte " + strconv.Itoa(e.Offset)
}

// Unwrap returns ErrMalformed or ErrUnsupportedVersion.
func (e *FormatError) Unwrap() error { return e.err }

// ---- encoding ----

// appendMessage appends m without its MAC, which covers exactly the
// bytes appended. It checks every limit, so what it produces parses.
func appendMessage(b []byte, m *message) ([]byte, error) {
	if err := checkKeyID(m.keyID, true); err != nil {
		return b, err
	}
	if err := checkName("publisher name", m.publisher, false); err != nil {
		return b, err
	}
	if m.seq == 0 {
		return b, errors.New("caughtup/feed: sequence numbers start at 1")
	}
	o := &m.obs
	if err := checkObservation(o); err != nil {
		return b, err
	}
	start := len(b)
	b = append(b, formatVersion)
	b = appendStr8(b, m.keyID)
	b = appendStr8(b, m.publisher)
	b = binary.BigEndian.AppendUint64(b, m.instance)
	b = binary.AppendUvarint(b, m.seq)
	b = binary.AppendVarint(b, m.sentAt.UnixMicro())
	b = binary.AppendUvarint(b, uint64(max(m.ttl, 0)/time.Millisecond))
	b = binary.AppendUvarint(b, uint64(max(m.held, 0)/time.Microsecond))
	b = appendStr8(b, o.Database)
	b = appendStr8(b, o.Node)
	b = append(b, byte(o.Role))
	errText := cutErr(o.Err)
	b = binary.AppendUvarint(b, uint64(len(errText)))
	b = append(b, errText...)
	if errText == "" {
		switch o.Role {
		case RolePrimary:
			p := &o.Primary
			var flags byte
			if p.HistoryKnown {
				flags |= flagHistoryKnown
			}
			b = append(b, flags)
			b = binary.BigEndian.AppendUint64(b, p.Epoch.SystemID)
			b = binary.AppendUvarint(b, uint64(p.Epoch.Timeline))
			b = binary.AppendUvarint(b, uint64(p.InsertLSN))
			b = binary.AppendUvarint(b, p.WAL.MaxAlign)
			b = binary.AppendUvarint(b, p.WAL.BlockSize)
			b = binary.AppendUvarint(b, p.WAL.SegmentSize)
			h := p.History
			if !p.HistoryKnown {
				h = nil
			}
			b = binary.AppendUvarint(b, uint64(len(h)))
			for _, s := range h {
				b = binary.AppendUvarint(b, uint64(s.Timeline))
				b = binary.AppendUvarint(b, uint64(s.Switchpoint))
			}
		case RoleReplica:
			r := &o.Replica
			var flags byte
			if r.InRecovery {
				flags |= flagInRecovery
			}
			if !r.ReplayTimestamp.IsZero() {
				flags |= flagReplayTS
			}
			if !r.Incarnation.IsZero() {
				flags |= flagIncarnation
				if !r.RecoveryStart.IsZero() {
					flags |= flagRecoveryStart
				}
			}
			b = append(b, flags)
			b = binary.AppendUvarint(b, uint64(r.Replayed))
			b = binary.BigEndian.AppendUint64(b, r.Epoch.SystemID)
			b = binary.AppendUvarint(b, uint64(r.Epoch.Timeline))
			if flags&flagReplayTS != 0 {
				b = binary.AppendVarint(b, r.ReplayTimestamp.UnixMicro())
			}
			b = binary.AppendUvarint(b, uint64(max(r.TimeLag, 0)/time.Microsecond))
			if flags&flagIncarnation != 0 {
				b = binary.AppendVarint(b, r.Incarnation.UnixMicro())
			}
			if flags&flagRecoveryStart != 0 {
				b = binary.AppendVarint(b, r.RecoveryStart.UnixMicro())
			}
		}
	}
	if n := len(b) - start; n+macSize > MaxMessageSize {
		return b[:start], fmt.Errorf("caughtup/feed: observation encodes to %d bytes, more than MaxMessageSize (%d); is the timeline history that long?", n+macSize, MaxMessageSize)
	}
	return b, nil
}

func appendStr8(b []byte, s string) []byte {
	b = append(b, byte(len(s)))
	return append(b, s...)
}

// checkObservation enforces what the decoder enforces, so that Publish
// refuses what no subscriber would accept.
func checkObservation(o *Observation) error {
	if err := checkName("database name", o.Database, false); err != nil {
		return err
	}
	switch o.Role {
	case RolePrimary:
		if err := checkName("primary node name", o.Node, true); err != nil {
			return err
		}
		if o.Err == "" && o.Primary.HistoryKnown && len(o.Primary.History) > MaxHistory {
			return fmt.Errorf("caughtup/feed: timeline history of %d entries, more than MaxHistory (%d)", len(o.Primary.History), MaxHistory)
		}
	case RoleReplica:
		if err := checkName("replica node name", o.Node, false); err != nil {
			return err
		}
	default:
		return fmt.Errorf("caughtup/feed: observation role %s; use RolePrimary or RoleReplica", o.Role)
	}
	return nil
}

// checkName accepts 1..MaxNameLen bytes (0 when empty is allowed) of
// UTF-8 without control characters: names end up in logs and metrics.
func checkName(what, s string, emptyOK bool) error {
	if s == "" && !emptyOK {
		return fmt.Errorf("caughtup/feed: empty %s", what)
	}
	if len(s) > MaxNameLen {
		return fmt.Errorf("caughtup/feed: %s of %d bytes, more than MaxNameLen (%d)", what, len(s), MaxNameLen)
	}
	if !validName(s) {
		return fmt.Errorf("caughtup/feed: %s %q is not UTF-8 without control characters", what, s)
	}
	return nil
}

func validName(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return false
		}
	}
	return true
}

// checkKeyID is sign.CheckKeyID, but for "" when emptyOK (unsigned).
func checkKeyID(id string, emptyOK bool) error {
	if id == "" && emptyOK {
		return nil
	}
	return sign.CheckKeyID(id)
}

// cutErr bounds an error text to MaxErrLen bytes of valid UTF-8.
func cutErr(s string) string {
	if len(s) <= MaxErrLen && utf8.ValidString(s) {
		return s
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= MaxErrLen {
		return s
	}
	s = s[:MaxErrLen]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1] // a rune cut in half: at most 3 bytes go
	}
	return s
}

// ---- decoding ----

// reader decodes strictly: minimal varints, bounded lengths, no trailing
// bytes. It never panics; the first fault sticks.
type reader struct {
	b   []byte
	off int
	err *FormatError
}

func (r *reader) fail(what string) {
	if r.err == nil {
		r.err = &FormatError{Offset: r.off, What: what, err: ErrMalformed}
	}
}

func (r *reader) byte(what string) byte {
	if r.err != nil || r.off >= len(r.b) {
		r.fail(what + ": truncated")
		return 0
	}
	c := r.b[r.off]
	r.off++
	return c
}

func (r *reader) fixed64(what string) uint64 {
	if r.err != nil || len(r.b)-r.off < 8 {
		r.fail(what + ": truncated")
		return 0
	}
	v := binary.BigEndian.Uint64(r.b[r.off:])
	r.off += 8
	return v
}

// uvarint reads a minimal unsigned varint (no redundant trailing 0x80
// groups), so that each value has exactly one encoding.
func (r *reader) uvarint(what string) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b[r.off:])
	switch {
	case n == 0:
		r.fail(what + ": truncated")
		return 0
	case n < 0:
		r.fail(what + ": varint overflows 64 bits")
		return 0
	case n > 1 && r.b[r.off+n-1] == 0:
		r.fail(what + ": varint not minimal")
		return 0
	}
	r.off += n
	return v
}

func (r *reader) varint(what string) int64 {
	u := r.uvarint(what)
	return int64(u>>1) ^ -int64(u&1) // zigzag, as binary.AppendVarint
}

func (r *reader) uint32(what string) uint32 {
	off := r.off
	v := r.uvarint(what)
	if v > 1<<32-1 {
		r.off = off
		r.fail(what + ": more than 32 bits")
		return 0
	}
	return uint32(v)
}

// micros reads a µs count that must fit a time.Duration.
func (r *reader) micros(what string) time.Duration {
	off := r.off
	v := r.uvarint(what)
	if v > uint64(1<<63-1)/uint64(time.Microsecond) {
		r.off = off
		r.fail(what + ": out of range")
		return 0
	}
	return time.Duration(v) * time.Microsecond
}

// timestamp reads µs since the Unix epoch as a non-zero UTC time.Time.
func (r *reader) timestamp(what string) time.Time {
	off := r.off
	v := r.varint(what)
	if r.err != nil {
		return time.Time{}
	}
	t := time.UnixMicro(v).UTC()
	if t.IsZero() || t.UnixMicro() != v {
		r.off = off
		r.fail(what + ": out of range")
		return time.Time{}
	}
	return t
}

func (r *reader) bytes(n int, what string) []byte {
	if r.err != nil || n > len(r.b)-r.off {
		r.fail(what + ": truncated")
		return nil
	}
	s := r.b[r.off : r.off+n]
	r.off += n
	return s
}

// name reads a length-prefixed name with checkName's rules.
func (r *reader) name(what string, emptyOK bool) string {
	off := r.off
	n := int(r.byte(what + " length"))
	s := r.bytes(n, what)
	if r.err != nil {
		return ""
	}
	if (n == 0 && !emptyOK) || n > MaxNameLen || !validName(string(s)) {
		r.off = off
		r.fail(what + ": empty, too long, or not UTF-8 without control characters")
		return ""
	}
	return string(s)
}

// parseMessage decodes b strictly. It checks the format only: the
// signature, the key and the sequence are the subscriber's to check.
func parseMessage(b []byte) (message, error) {
	var m message
	if len(b) > MaxMessageSize {
		return m, &FormatError{Offset: MaxMessageSize, What: "message of " + strconv.Itoa(len(b)) + " bytes: longer than MaxMessageSize", err: ErrMalformed}
	}
	r := &reader{b: b}
	if v := r.byte("format version"); r.err == nil && v != formatVersion {
		return m, &FormatError{Offset: 0, What: "version " + strconv.Itoa(int(v)), err: ErrUnsupportedVersion}
	}
	off := r.off
	n := int(r.byte("key ID length"))
	if id := r.bytes(n, "key ID"); r.err == nil {
		m.keyID = string(id)
		if checkKeyID(m.keyID, true) != nil {
			r.off = off
			r.fail("key ID: too long or not [A-Za-z0-9._-]")
		}
	}
	m.publisher = r.name("publisher name", false)
	m.instance = r.fixed64("publisher instance")
	off = r.off
	if m.seq = r.uvarint("sequence number"); r.err == nil && m.seq == 0 {
		r.off = off
		r.fail("sequence number: 0")
	}
	m.sentAt = time.UnixMicro(r.varint("sent at")).UTC()
	off = r.off
	if ms := r.uvarint("expiry"); r.err == nil {
		if ms > uint64(1<<63-1)/uint64(time.Millisecond) {
			r.off = off
			r.fail("expiry: out of range")
		}
		m.ttl = time.Duration(ms) * time.Millisecond
	}
	m.held = r.micros("held")
	o := &m.obs
	o.Database = r.name("database name", false)
	nodeOff := r.off
	o.Node = r.name("node name", true)
	roleOff := r.off
	o.Role = Role(r.byte("role"))
	if r.err == nil {
		switch o.Role {
		case RolePrimary:
		case RoleReplica:
			if o.Node == "" {
				r.off = nodeOff
				r.fail("node name: empty for a replica")
			}
		default:
			r.off = roleOff
			r.fail("role: " + o.Role.String())
		}
	}
	off = r.off
	en := r.uvarint("error text length")
	if r.err == nil && en > MaxErrLen {
		r.off = off
		r.fail("error text: longer than MaxErrLen")
	}
	if s := r.bytes(int(en), "error text"); r.err == nil {
		if !utf8.Valid(s) {
			r.off = off
			r.fail("error text: not UTF-8")
		}
		o.Err = string(s)
	}
	if r.err == nil && o.Err == "" {
		switch o.Role {
		case RolePrimary:
			r.primary(&o.Primary)
		case RoleReplica:
			r.replica(&o.Replica)
		}
	}
	if r.err == nil && m.keyID != "" {
		m.signed = b[:r.off]
		m.mac = r.bytes(macSize, "signature")
	}
	if r.err == nil && r.off != len(b) {
		r.fail(strconv.Itoa(len(b)-r.off) + " trailing bytes")
	}
	if r.err != nil {
		return message{}, r.err
	}
	return m, nil
}

func (r *reader) primary(p *PrimaryStatus) {
	off := r.off
	flags := r.byte("primary flags")
	if flags&^flagHistoryKnown != 0 {
		r.off = off
		r.fail("primary flags: unknown bits")
	}
	p.HistoryKnown = flags&flagHistoryKnown != 0
	p.Epoch.SystemID = r.fixed64("system identifier")
	p.Epoch.Timeline = r.uint32("timeline")
	p.InsertLSN = position.LSN(r.uvarint("insert LSN"))
	p.WAL.MaxAlign = r.uvarint("max alignment")
	p.WAL.BlockSize = r.uvarint("WAL block size")
	p.WAL.SegmentSize = r.uvarint("WAL segment size")
	off = r.off
	n := r.uvarint("history length")
	if r.err != nil {
		return
	}
	if n > MaxHistory || (n > 0 && !p.HistoryKnown) {
		r.off = off
		r.fail("history length: more than MaxHistory, or entries while the history is unknown")
		return
	}
	if n > 0 {
		// Each entry takes at least 2 bytes: no allocation beyond what
		// the input can fill.
		if int(n) > (len(r.b)-r.off)/2 {
			r.fail("history: truncated")
			return
		}
		p.History = make(position.History, n)
		for i := range p.History {
			p.History[i].Timeline = r.uint32("history timeline")
			p.History[i].Switchpoint = position.LSN(r.uvarint("history switchpoint"))
		}
	}
}

func (r *reader) replica(s *ReplicaStatus) {
	off := r.off
	flags := r.byte("replica flags")
	if flags&^replicaFlagsDefine != 0 || (flags&flagRecoveryStart != 0 && flags&flagIncarnation == 0) {
		r.off = off
		r.fail("replica flags: unknown bits, or a recovery start without an incarnation")
	}
	s.InRecovery = flags&flagInRecovery != 0
	s.Replayed = position.LSN(r.uvarint("replay LSN"))
	s.Epoch.SystemID = r.fixed64("system identifier")
	s.Epoch.Timeline = r.uint32("received timeline")
	if flags&flagReplayTS != 0 {
		s.ReplayTimestamp = r.timestamp("replay timestamp")
	}
	s.TimeLag = r.micros("time lag")
	if flags&flagIncarnation != 0 {
		s.Incarnation = r.timestamp("incarnation")
	}
	if flags&flagRecoveryStart != 0 {
		s.RecoveryStart = r.timestamp("recovery start")
	}
}
