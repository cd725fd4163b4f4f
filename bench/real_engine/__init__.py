"""The benches on one real vLLM replica (the real-engine tier's CPU build): the priority study (`study`, its
traffic in `traffic`, the simulator fitted to the engine in `timing`, its report and plots in `report` and `plots`),
the gateway's overhead (`overhead`), what one eviction costs (`resume_cost`) and what the metrics scrape costs
(`scrape_cost`)."""
