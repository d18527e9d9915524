package enforcer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/region"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/fsutil"
	"golang.org/x/sys/unix"
)

// restore loads the instance table and re-adopts every instance whose
// processes live: its region is re-opened (or made anew when it is gone),
// enforcer_epoch is bumped, the slots' memfds are found again in the
// processes that hold them (or made anew), live slots are watched again
// and dead ones reaped. A device whose config changed its settings keeps the ones its
// instances run under until it is empty.
func (e *Enforcer) restore() error {
	st, err := loadState(e.statePth, e.index)
	var ce *CorruptStateError
	if errors.As(err, &ce) && writtenBefore(e.statePth, e.bootTime) {
		// The table is written without fsync (save): a machine crash can
		// leave it cut short, and it then describes processes of a boot
		// that has ended. Kept aside, never trusted.
		aside := e.statePth + ".before-boot"
		if rerr := os.Rename(e.statePth, aside); rerr != nil {
			return errors.Join(err, rerr)
		}
		e.o.log.Warn("the state file was last written before this boot and is unreadable (a crash can leave it so); moved aside, the device starts empty",
			"path", e.statePth, "aside", aside, "err", ce.Err)
		st, err = nil, nil
	}
	if err != nil {
		return err
	}
	e.configured = e.cfg.Device(e.index)
	e.settings = e.configured
	if st != nil && len(st.Instances) > 0 {
		running := e.configured
		running.ComputePolicy = st.Policy
		running.ComputeTimeslice = st.TimesliceMS
		running.ComputeTimesliceNativeBurst = st.NativeSliceUS
		running.OnlineOfflineSwitch = st.OnlineOffline
		if running != e.configured {
			e.o.log.Warn(fmt.Sprintf("device %d: the config's change to %s (compute_timeslice %d, compute_timeslice_native_burst %d, online_offline_switch %d) is refused while %d instances run under %s (compute_timeslice %d, compute_timeslice_native_burst %d, online_offline_switch %d); it takes effect when the device is empty",
				e.index, e.configured.ComputePolicy, e.configured.ComputeTimeslice, e.configured.ComputeTimesliceNativeBurst, e.configured.OnlineOfflineSwitch,
				len(st.Instances), running.ComputePolicy, running.ComputeTimeslice, running.ComputeTimesliceNativeBurst, running.OnlineOfflineSwitch))
		}
		e.settings = running
	}
	if st != nil {
		e.epoch = st.Epoch
	}
	e.epoch++
	e.arb = e.newArbiter()
	if st != nil {
		sameBoot := st.BootID == "" || e.bootID == "" || st.BootID == e.bootID
		for _, si := range st.Instances {
			if err := e.adopt(si, sameBoot); err != nil {
				return err
			}
		}
	}
	e.removeStrayRegions()
	if len(e.list) == 0 {
		e.applyPendingLocked()
	}
	e.restored = true
	return e.save()
}

// writtenBefore reports whether path was last modified before t (the boot
// time; false when either is unknown).
func writtenBefore(path string, t time.Time) bool {
	fi, err := os.Stat(path)
	return err == nil && !t.IsZero() && fi.ModTime().Before(t)
}

func (e *Enforcer) adopt(si stateInstance, sameBoot bool) error {
	in := newInstance()
	in.id, in.name, in.kind, in.containerID, in.pod = si.ID, si.Name, si.Kind, si.ContainerID, si.Pod
	in.pid, in.startTime, in.pidNS, in.cgroup = si.PID, si.StartTime, si.PidNS, si.Cgroup
	in.policy, in.class, in.core, in.memMiB, in.created = si.Policy, si.Class, si.Core, si.MemoryMiB, si.Created
	in.reapedGPU, in.reapedThrottled, in.reapedLaunches = min(si.ReapedGPUNs, satCap), min(si.ReapedThrottledNs, satCap), min(si.ReapedLaunches, satCap)
	in.qcap = queueCap(uint64(in.maxQueued()), uint64(e.settings.Period())) //nolint:gosec // positive
	in.path = filepath.Join(e.regions, in.name)
	rootAlive := sameBoot && e.alive(in.pid, in.startTime)

	reg, err := region.Open(in.path)
	if err == nil && reg.Params() != e.params(in) {
		_ = reg.Close()
		err = fmt.Errorf("region %s: %w: header %+v does not match the instance", in.path, region.ErrInvalid, reg.Params())
	}
	if err != nil {
		if !rootAlive {
			_ = region.Remove(in.path)
			e.o.log.Info("released", "instance", in.name, "container", in.containerID, "reason", "its processes are gone")
			return nil
		}
		e.o.log.Warn("region unusable; creating it anew (processes attached to the old one must restart)", "instance", in.name, "err", err)
		_ = region.Remove(in.path)
		if reg, err = region.Create(in.path, e.params(in)); err != nil {
			return err
		}
	}
	in.reg = reg
	reg.L().EnforcerEpoch.Add(1)
	if !e.adoptSlots(in, sameBoot) {
		_ = reg.Close()
		_ = region.Remove(in.path)
		e.o.log.Info("released", "instance", in.name, "container", in.containerID, "reason", "an access to a slot of one of its processes faulted")
		return nil
	}
	if rootAlive {
		if fd, err := e.pidfd(in.pid, in.startTime); err == nil {
			in.rootFD = e.watchLocked(fd, watchRef{in: in, slot: -1})
		} else {
			rootAlive = false
		}
	}
	if !rootAlive {
		in.rootGone = true
		if in.nused == 0 {
			_ = reg.Close()
			_ = region.Remove(in.path)
			e.o.log.Info("released", "instance", in.name, "container", in.containerID, "reason", "its processes are gone")
			return nil
		}
	}
	e.insertLocked(in)
	e.o.log.Info("restored", "instance", in.name, "container", in.containerID, "processes", in.nused)
	return nil
}

// adoptSlots gives the slots of in's re-opened region their memory and
// watches their live processes again. The slots' memfds died with the
// previous enforcer; a live attached process still maps its own (and those
// of the peers it asked for), so each is found again where the slots'
// live owners hold it (region.Recover); a slot found nowhere is held by
// no process, and gets a new memfd when one attaches to it. A live process
// whose slot's memfd is found nowhere (it unmapped it) is reaped as if it
// had exited; so is every dead one. Reaping reads and clears a slot that
// processes may map, under fault (guard says when that can fault): if it
// faults, the instance is released and adoptSlots reports false.
func (e *Enforcer) adoptSlots(in *instance, sameBoot bool) bool {
	reg := in.reg
	live := map[int]int{} // slot -> pidfd
	var holders []region.Holder
	for i := range region.MaxProcs {
		p := reg.Proc(i)
		if pid := int(p.PID.Load()); pid != 0 && sameBoot {
			if fd, err := e.pidfd(pid, p.StartTime.Load()); err == nil {
				live[i] = fd
				holders = append(holders, region.Holder{PID: pid, PidFD: fd})
			}
		}
	}
	found := map[int]bool{}
	for _, i := range reg.Recover(holders) {
		found[i] = true
	}
	var keep, reap []int
	for i := range region.MaxProcs {
		pid := reg.Proc(i).PID.Load()
		switch fd, ok := live[i]; {
		case pid == 0:
		case ok && found[i]:
			keep = append(keep, i)
		case ok:
			_ = unix.Close(fd)
			delete(live, i)
			e.o.log.Warn("a live process holds its slot's memory no more; its slot is reaped as if it had exited",
				"instance", in.name, "container", in.containerID, "slot", i, "pid", pid)
			reap = append(reap, i)
		default:
			reap = append(reap, i)
		}
	}
	if _, faulted := fault(func() {
		for _, i := range reap {
			if reg.Proc(i).Counters != nil { // found in a peer: its last counters
				in.sane[i] = sane{trusted: true}
				e.fold(in, i)
			}
			reg.Proc(i).Clear()
		}
	}); faulted {
		for _, fd := range live {
			_ = unix.Close(fd)
		}
		e.o.log.Warn("an access to a slot faulted while the instance's dead processes were reaped; releasing the instance",
			"instance", in.name, "container", in.containerID)
		return false
	}
	for _, i := range keep {
		fd := live[i]
		in.setUsed(i)
		in.sane[i] = sane{trusted: true} // its counters so far, as they are
		in.slotFD[i] = e.watchLocked(fd, watchRef{in: in, slot: i})
	}
	// The region's bitmap may still show slots just reaped (or none, in a
	// region of the layout before it).
	reg.SetUsed(in.used)
	reg.Upgrade()
	return true
}

// removeStrayRegions deletes regions of no instance (a crash between
// creating a region and writing the state).
func (e *Enforcer) removeStrayRegions() {
	ents, err := os.ReadDir(e.regions)
	if err != nil {
		return
	}
	for _, ent := range ents {
		dev, id, err := api.ParseInstanceName(ent.Name())
		if err == nil && dev == e.index && e.byID[id] != nil {
			continue
		}
		p := filepath.Join(e.regions, ent.Name())
		if err := region.Remove(p); err == nil {
			e.o.log.Info("removed stray region", "path", p)
		}
	}
}

// save writes the instance table atomically. Concurrent callers are
// ordered: an older snapshot never overwrites a newer one.
func (e *Enforcer) save() error {
	e.mu.Lock()
	st := stateFile{
		Version: StateVersion, Device: e.index, BootID: e.bootID, Epoch: e.epoch,
		Policy: e.settings.ComputePolicy, TimesliceMS: e.settings.ComputeTimeslice,
		NativeSliceUS: e.settings.ComputeTimesliceNativeBurst,
		OnlineOffline: e.settings.OnlineOfflineSwitch,
		Instances:     make([]stateInstance, 0, len(e.list)),
	}
	for _, in := range e.list {
		st.Instances = append(st.Instances, in.record())
	}
	e.saveSeq++
	seq := e.saveSeq
	e.mu.Unlock()
	data, err := json.MarshalIndent(&st, "", "  ")
	if err != nil {
		return err
	}
	data = append(data, '\n')
	e.saveMu.Lock()
	defer e.saveMu.Unlock()
	if seq <= e.savedAt {
		return nil
	}
	// No fsync: the table describes this boot's processes only, and a file
	// a crash leaves behind is void at the next start (restore).
	if err := fsutil.ReplaceFile(e.statePth, data, 0o600); err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	e.savedAt = seq
	return nil
}

// Reload takes a re-read configuration (SIGHUP). max_instances applies at
// once; policy and time slices apply at once when the device is empty and
// otherwise when it becomes empty, never under running instances.
// Everything else (directories, backend, devices) needs a restart.
func (e *Enforcer) Reload(cfg *config.Config) error {
	if cfg == nil {
		return errors.New("reload: no configuration")
	}
	next := cfg.Device(e.index)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.configured = next
	e.settings.MaxInstances = next.MaxInstances
	if len(e.list) == 0 {
		e.applyPendingLocked()
		return nil
	}
	if e.settings != e.configured {
		e.o.log.Warn(fmt.Sprintf("device %d: the config's change to %s (online_offline_switch %d) is refused while %d instances run under %s (online_offline_switch %d); it takes effect when the device is empty",
			e.index, next.ComputePolicy, next.OnlineOfflineSwitch, len(e.list), e.settings.ComputePolicy, e.settings.OnlineOfflineSwitch))
	}
	return nil
}
