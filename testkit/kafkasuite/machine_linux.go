package kafkasuite

import (
	"bytes"
	"os"
	"strconv"
	"time"
)

// clockTicks is USER_HZ, the unit of /proc/stat: 100 on every Linux
// architecture Go runs on.
const clockTicks = 100

// MachineCPUTime is the CPU time every core of the machine has spent
// busy (user, nice, system, interrupts, stolen) since boot, from
// /proc/stat, to 10ms; 0 if it cannot be read. Over a benchmark's window
// it shows whether the cores, which the broker, the database servers and
// the test process share, were the bound.
func MachineCPUTime() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	fields := bytes.Fields(line)
	if len(fields) < 9 || string(fields[0]) != "cpu" {
		return 0
	}
	var busy int64
	// user nice system idle iowait irq softirq steal: all but idle and
	// iowait.
	for i, f := range fields[1:9] {
		if i == 3 || i == 4 {
			continue
		}
		n, err := strconv.ParseInt(string(f), 10, 64)
		if err != nil {
			return 0
		}
		busy += n
	}
	return time.Duration(busy) * time.Second / clockTicks
}
