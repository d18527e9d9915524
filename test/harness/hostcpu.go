package harness

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// HostCPU is this machine's CPU time, all CPUs together, in clock ticks
// (the "cpu" line of /proc/stat).
type HostCPU struct {
	Total, Steal uint64
}

// ReadHostCPU reads /proc/stat.
func ReadHostCPU() (HostCPU, error) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return HostCPU{}, err
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// cpu user nice system idle iowait irq softirq steal guest guest_nice
		fields := strings.Fields(sc.Text())
		if len(fields) < 9 || fields[0] != "cpu" {
			continue
		}
		var c HostCPU
		for i, s := range fields[1:9] {
			v, err := strconv.ParseUint(s, 10, 64)
			if err != nil {
				return HostCPU{}, fmt.Errorf("/proc/stat: %q: %w", s, err)
			}
			c.Total += v
			if i == 7 {
				c.Steal = v
			}
		}
		return c, nil
	}
	if err := sc.Err(); err != nil {
		return HostCPU{}, err
	}
	return HostCPU{}, fmt.Errorf("/proc/stat has no cpu line")
}

// StealPercent is the share of this machine's CPU time that the hypervisor
// gave to others between a and b (0 when it cannot tell). The simulated
// device's threads run on these CPUs, so a window with much steal measured
// a device slowed down by the host, not only the enforcement.
func StealPercent(a, b HostCPU) float64 {
	if b.Total <= a.Total || b.Steal < a.Steal {
		return 0
	}
	return 100 * float64(b.Steal-a.Steal) / float64(b.Total-a.Total)
}
