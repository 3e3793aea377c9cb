package position

import (
	"strconv"
	"strings"
)

// Epoch names one WAL history: the cluster's system identifier (from
// pg_control_system(), fixed at initdb) and the timeline, which a promotion
// increments. Two LSNs mean the same place only within one Epoch, or across
// timelines up to the switchpoint where one became the other.
type Epoch struct {
	// SystemID is pg_control_system().system_identifier. Zero means
	// unknown, and an unknown epoch is never comparable.
	SystemID uint64 `json:"system_id,string"`
	// Timeline is the timeline ID; PostgreSQL's first timeline is 1, so
	// zero means unknown.
	Timeline uint32 `json:"timeline"`
}

// IsZero reports whether the epoch is unknown in any part.
func (e Epoch) IsZero() bool { return e.SystemID == 0 || e.Timeline == 0 }

// String prints "<system id>/<timeline>", both in decimal, as
// pg_controldata does.
func (e Epoch) String() string {
	return strconv.FormatUint(e.SystemID, 10) + "/" + strconv.FormatUint(uint64(e.Timeline), 10)
}

// TimelineSwitch is one line of a timeline history file: timeline Timeline
// ended at Switchpoint, where its child began. WAL below Switchpoint is
// shared by the parent and the child.
type TimelineSwitch struct {
	Timeline    uint32 `json:"timeline"`
	Switchpoint LSN    `json:"switchpoint"`
}

// History lists the ancestors of one timeline with their switchpoints, as
// in PostgreSQL's 0000000N.history file or the replication command
// TIMELINE_HISTORY. The slice is small (one line per promotion) and scanned
// linearly.
type History []TimelineSwitch

// Switchpoint returns where timeline tli ended in this history.
func (h History) Switchpoint(tli uint32) (LSN, bool) {
	for _, s := range h {
		if s.Timeline == tli {
			return s.Switchpoint, true
		}
	}
	return 0, false
}

// ParseHistory reads the text of a timeline history file: lines of
// "<parent tli>\t<switchpoint X/Y>\t<reason>", with blank lines and
// '#' comments ignored.
func ParseHistory(text string) (History, error) {
	var h History
	for line := range strings.Lines(text) {
		line = strings.TrimRight(line, "\r\n")
		fields := strings.Fields(line)
		if len(fields) == 0 || fields[0][0] == '#' {
			continue
		}
		if len(fields) < 2 {
			return nil, &SyntaxError{What: "timeline history line", Input: line}
		}
		tli, err := strconv.ParseUint(fields[0], 10, 32)
		if err != nil || tli == 0 {
			return nil, &SyntaxError{What: "timeline history line", Input: line}
		}
		sp, err := ParseLSN(fields[1])
		if err != nil {
			return nil, &SyntaxError{What: "timeline history line", Input: line}
		}
		h = append(h, TimelineSwitch{Timeline: uint32(tli), Switchpoint: sp})
	}
	return h, nil
}
