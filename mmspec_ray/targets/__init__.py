"""mmspec_ray.targets"""
